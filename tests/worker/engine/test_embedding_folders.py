"""Embedding model folders: how each says it pools (sentence-transformers' files, a bare base model,
the task asked for), what is refused by name, and a bare base model's checkpoint (no "model.", no
lm_head) read as its causal LM's arch and loaded weight for weight."""
import json
import shutil

import pytest
import torch

from tests.worker.engine.conftest import TINY
from worker.models.config import read_model_config
from worker.models.demo import build_embedding_dir, build_model_dir
from worker.models.loader import load_model
from worker.models.pooling import Pooling, read_pooling

QWEN3 = dict(TINY, arch="qwen3", head_dim=16)  # Qwen3Config's own head_dim is 128
MISTRAL = dict(TINY, arch="mistral")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A Qwen3-Embedding-like folder (bare Qwen3Model, last token, Normalize), an e5-mistral-like one
    (bare MistralModel, no sentence-transformers files) and the causal folders they were saved from."""
    root = tmp_path_factory.mktemp("embedding")
    return dict(qwen3=build_embedding_dir(root / "qwen3", **QWEN3),
                mistral=build_embedding_dir(root / "mistral", pooling=None, **MISTRAL),
                causal_qwen3=build_model_dir(root / "causal_qwen3", **QWEN3),
                causal_mistral=build_model_dir(root / "causal_mistral", **MISTRAL))


def edited(src, dst, file: str, **changes):
    """A copy of the folder with `changes` written into one of its JSON files (None: the key removed)."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / file).read_text())
    raw.update(changes)
    (dst / file).write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    return dst


def test_last_token_then_normalize(folders):
    assert read_pooling(folders["qwen3"]) == Pooling("last", True, None)


def test_mean_without_normalize_on_a_causal_checkpoint(tmp_path):
    """gte-style: sentence-transformers' files beside a ForCausalLM checkpoint."""
    folder = build_embedding_dir(tmp_path, pooling="mean_tokens", normalize=False, bare=False, **QWEN3)
    assert read_pooling(folder) == Pooling("mean", False)
    assert read_pooling(folder, "embed") == Pooling("mean", False)  # the folder's own pooling, not the default


def test_a_bare_base_model_without_sentence_transformers_files_pools_its_last_token(folders):
    assert not (folders["mistral"] / "modules.json").exists()
    assert read_pooling(folders["mistral"]) == Pooling("last", True)


def test_the_task_decides_for_a_generative_folder(folders):
    assert read_pooling(folders["causal_qwen3"]) is None
    assert read_pooling(folders["causal_qwen3"], "embed") == Pooling("last", True)
    assert read_pooling(folders["qwen3"], "generate") is None
    with pytest.raises(ValueError, match="task 'classify': one of auto, embed, generate"):
        read_pooling(folders["qwen3"], "classify")


@pytest.mark.parametrize("matryoshka,dimensions", [(True, ()), ([16, 32, 64], (16, 32, 64))])
def test_matryoshka_lengths_from_the_config(tmp_path, matryoshka, dimensions):
    folder = build_embedding_dir(tmp_path, matryoshka=matryoshka, **QWEN3)
    assert read_pooling(folder) == Pooling("last", True, dimensions)


POOLING = "1_Pooling/config.json"


@pytest.mark.parametrize("file,changes,message", [
    (POOLING, dict(pooling_mode_lasttoken=False, pooling_mode_cls_token=True),
     r"1_Pooling/config.json pools by \['pooling_mode_cls_token'\]: supported is exactly one of "
     "pooling_mode_lasttoken, pooling_mode_mean_tokens"),
    (POOLING, dict(pooling_mode_lasttoken=False, pooling_mode_weightedmean_tokens=True),
     r"pools by \['pooling_mode_weightedmean_tokens'\]"),
    (POOLING, dict(pooling_mode_mean_tokens=True),
     r"pools by \['pooling_mode_mean_tokens', 'pooling_mode_lasttoken'\]"),
    (POOLING, dict(pooling_mode_lasttoken=False), "pools by no mode"),
    (POOLING, dict(include_prompt=False), "1_Pooling/config.json says include_prompt false"),
    ("config.json", dict(use_bidirectional_attention=True),
     "use_bidirectional_attention true in .*config.json: bidirectional attention is not supported"),
    ("config.json", dict(is_causal=False), "is_causal false in .*config.json: bidirectional attention"),
])
def test_what_no_causal_pooling_computes_is_refused_by_name(folders, tmp_path, file, changes, message):
    folder = edited(folders["qwen3"], tmp_path / "folder", file, **changes)
    with pytest.raises(ValueError, match=message) as refused:
        read_pooling(folder)
    assert str(folder) in str(refused.value)


def test_a_module_past_normalize_is_refused(folders, tmp_path):
    folder = tmp_path / "dense"
    shutil.copytree(folders["qwen3"], folder)
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=rf"{folder}/modules.json lists modules \['Transformer', 'Pooling', "
                                         r"'Normalize', 'Dense'\]: supported are Transformer, Pooling and optionally"):
        read_pooling(folder)


def test_a_missing_pooling_config_is_refused(folders, tmp_path):
    folder = tmp_path / "folder"
    shutil.copytree(folders["qwen3"], folder)
    (folder / POOLING).unlink()
    with pytest.raises(ValueError, match=rf"{folder}/1_Pooling/config.json is missing or unreadable"):
        read_pooling(folder)


@pytest.mark.parametrize("name", ["qwen3", "mistral"])
def test_a_bare_base_model_reads_as_its_causal_lm(folders, tmp_path, name):
    """By its architecture's name alone too, where no model_type says the family."""
    raw = json.loads((folders[name] / "config.json").read_text())
    assert raw["architectures"] == [{"qwen3": "Qwen3Model", "mistral": "MistralModel"}[name]]
    causal = read_model_config(folders[f"causal_{name}"])
    assert read_model_config(folders[name]) == causal
    assert read_model_config(edited(folders[name], tmp_path / "untyped", "config.json", model_type=None)) == causal


def test_a_bert_encoder_stays_unsupported(folders, tmp_path):
    folder = edited(folders["qwen3"], tmp_path / "bert", "config.json", architectures=["BertModel"],
                    model_type="bert")
    with pytest.raises(ValueError, match=r"unsupported architecture \['BertModel'\]"):
        read_model_config(folder)


@pytest.mark.parametrize("name", ["qwen3", "mistral"])
def test_a_bare_checkpoint_loads_weight_for_weight(folders, name):
    """Every parameter as transformers' base model holds it (q_proj in the fused qkv rows), the head
    the embeddings."""
    from safetensors import safe_open
    from transformers import AutoModel

    folder = folders[name]
    saved = set(safe_open(str(folder / "model.safetensors"), "pt").keys())
    assert "lm_head.weight" not in saved and not any(key.startswith("model.") for key in saved)
    stored = AutoModel.from_pretrained(folder, dtype=torch.float32).state_dict()
    cfg = read_model_config(folder)
    params = dict(load_model(folder, cfg, torch.device("cpu"), torch.float32, None).named_parameters())
    q_rows = cfg.num_heads * cfg.head_dim
    assert torch.equal(params["model.embed_tokens.weight"], stored["embed_tokens.weight"])
    assert torch.equal(params["model.layers.1.self_attn.qkv_proj.weight"][:q_rows],
                       stored["layers.1.self_attn.q_proj.weight"])
    assert torch.equal(params["model.norm.weight"], stored["norm.weight"])
    assert torch.equal(params["lm_head.weight"], stored["embed_tokens.weight"])
