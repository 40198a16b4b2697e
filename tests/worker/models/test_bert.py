"""worker/models/bert.py computes what transformers computes for BERT and XLM-RoBERTa folders (final
hidden states at every real token of a right-padded batch, classifier logits), loads checkpoints
however they prefix their tensors, and refuses by name the configs it does not compute."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from worker.models.bert import ACTIVATIONS, is_encoder, load_encoder, read_encoder_config
from worker.models.demo import build_encoder_dir

TEXTS = ["the cache", "a worker reads the stream of every request in the batch queue",
         "héllo naïve café, 你好 世界 42"]  # three lengths: the first two rows are right-padded
QUERY, DOC = "what is the cache", "the cache holds every block of the stream"

FOLDERS = {"bert": dict(kind="bert"), "xlmr": dict(kind="xlm-roberta", pooling="mean"),
           "bert-1": dict(kind="bert", classifier=True, num_labels=1),
           "bert-3": dict(kind="bert", classifier=True, num_labels=3),
           "xlmr-1": dict(kind="xlm-roberta", classifier=True, num_labels=1),
           "xlmr-3": dict(kind="xlm-roberta", classifier=True, num_labels=3)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    return {name: build_encoder_dir(root / name, **kw) for name, kw in FOLDERS.items()}


def _batch(folder, *texts):
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    batch = tokenizer(*texts, padding=True, return_tensors="pt")
    assert tokenizer.padding_side == "right"
    return batch


def _ours(folder, batch):
    model = load_encoder(folder, torch.device("cpu"), torch.float32)
    token_type_ids = batch.get("token_type_ids", torch.zeros_like(batch["input_ids"]))
    with torch.no_grad():
        return model, model(batch["input_ids"], batch["attention_mask"].bool(), token_type_ids)


@pytest.mark.parametrize("name", ["bert", "xlmr"])
def test_hidden_states_match_transformers_on_a_right_padded_batch(folders, name):
    batch = _batch(folders[name], TEXTS)
    lengths = batch["attention_mask"].sum(1)
    assert len(set(lengths.tolist())) == 3 and (batch["attention_mask"][:, -1] == 0).sum() == 2
    reference = transformers.AutoModel.from_pretrained(folders[name]).eval()
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state
    _, hidden = _ours(folders[name], batch)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(hidden[real], expected[real], atol=1e-5, rtol=0)


def test_bert_pair_uses_its_token_type_ids(folders):
    batch = _batch(folders["bert"], [QUERY, "the cache"], [DOC, "a block"])
    assert batch["token_type_ids"].any()
    reference = transformers.AutoModel.from_pretrained(folders["bert"]).eval()
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state
    _, hidden = _ours(folders["bert"], batch)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(hidden[real], expected[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["bert-1", "bert-3", "xlmr-1", "xlmr-3"])
def test_classifier_logits_match_transformers(folders, name):
    batch = _batch(folders[name], [QUERY, QUERY, "cache"], [DOC, "water and people", "a cache block"])
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(folders[name]).eval()
    with torch.no_grad():
        expected = reference(**batch).logits
    model, hidden = _ours(folders[name], batch)
    with torch.no_grad():
        logits = model.classify(hidden)
    assert logits.shape == (3, FOLDERS[name]["num_labels"])
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


def test_a_masked_lm_folder_is_served_as_its_encoder(folders, tmp_path):
    config = transformers.AutoConfig.from_pretrained(folders["xlmr"])
    torch.manual_seed(1)
    masked = transformers.XLMRobertaForMaskedLM(config).eval()
    masked.save_pretrained(tmp_path)
    batch = _batch(folders["xlmr"], TEXTS)
    with torch.no_grad():
        expected = masked.roberta(**batch).last_hidden_state
    model, hidden = _ours(tmp_path, batch)
    assert model.cfg.classifier is None
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(hidden[real], expected[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["gelu", "gelu_new", "gelu_pytorch_tanh", "relu"])
def test_activations_are_transformers_own(name):
    from transformers.activations import ACT2FN

    x = torch.linspace(-6, 6, 1001)
    torch.testing.assert_close(ACTIVATIONS[name](x), ACT2FN[name](x), atol=0, rtol=0)


def test_config_reads_heads_and_dtype(folders, tmp_path):
    assert read_encoder_config(folders["bert"]).classifier is None
    cfg = read_encoder_config(folders["xlmr-3"])
    assert (cfg.classifier, cfg.num_labels, cfg.pad_token_id, cfg.max_tokens) == ("roberta", 3, 1, 512)
    assert (read_encoder_config(folders["bert-1"]).classifier, read_encoder_config(folders["bert"]).max_tokens) \
        == ("bert", 512)
    raw = json.loads((folders["bert"] / "config.json").read_text())
    raw.pop("dtype", None)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "torch_dtype": "bfloat16"}))  # transformers 4's name
    assert read_encoder_config(tmp_path).dtype == "bfloat16"
    assert is_encoder(raw) and is_encoder({"model_type": "xlm-roberta"}) and not is_encoder({"model_type": "llama"})


@pytest.mark.parametrize("field, value", [
    ("position_embedding_type", "relative_key"), ("is_decoder", True), ("add_cross_attention", True),
    ("hidden_act", "silu"), ("architectures", ["BertForTokenClassification"]),
    ("architectures", ["XLMRobertaModel"]), ("model_type", "distilbert")])
def test_refuses_what_it_does_not_compute_by_name(folders, tmp_path, field, value):
    raw = json.loads((folders["bert"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, field: value}))
    with pytest.raises(ValueError, match=field):
        read_encoder_config(tmp_path)


def test_a_missing_weight_is_named(folders, tmp_path):
    shutil.copytree(folders["bert-1"], tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["bert.encoder.layer.1.output.dense.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"encoder\.layer\.1\.output\.dense\.weight"):
        load_encoder(tmp_path, torch.device("cpu"), torch.float32)


def test_tf_era_layer_norm_names_load(folders, tmp_path):
    shutil.copytree(folders["bert"], tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    tf_era = {"LayerNorm.weight": "LayerNorm.gamma", "LayerNorm.bias": "LayerNorm.beta"}
    renamed = {}
    for name, tensor in tensors.items():
        for new, old in tf_era.items():
            name = name.replace(new, old)
        renamed["bert." + name] = tensor
    save_file(renamed, tmp_path / "model.safetensors")
    batch = _batch(folders["bert"], TEXTS)
    _, hidden = _ours(tmp_path, batch)
    _, expected = _ours(folders["bert"], batch)
    torch.testing.assert_close(hidden, expected, atol=0, rtol=0)


def test_built_folders_load_as_their_families(folders):
    bert = transformers.AutoTokenizer.from_pretrained(folders["bert"])
    pair = bert(QUERY, DOC)
    ids = pair["input_ids"]
    q, d = len(bert(QUERY)["input_ids"]) - 2, len(bert(DOC)["input_ids"]) - 2
    assert ids[0] == bert.cls_token_id and ids[1 + q] == bert.sep_token_id and ids[-1] == bert.sep_token_id
    assert len(ids) == q + d + 3 and pair["token_type_ids"] == [0] * (q + 2) + [1] * (d + 1)
    xlmr = transformers.AutoTokenizer.from_pretrained(folders["xlmr"])
    ids = xlmr(QUERY, DOC)["input_ids"]
    q, d = len(xlmr(QUERY)["input_ids"]) - 2, len(xlmr(DOC)["input_ids"]) - 2
    s, e = xlmr.cls_token_id, xlmr.sep_token_id
    assert (s, xlmr.pad_token_id, e) == (0, 1, 2)
    assert len(ids) == q + d + 4 and ids[0] == s and ids[1 + q:3 + q] == [e, e] and ids[-1] == e
    assert isinstance(transformers.AutoModel.from_pretrained(folders["bert"]), transformers.BertModel)
    assert isinstance(transformers.AutoModel.from_pretrained(folders["xlmr"]), transformers.XLMRobertaModel)
    pooling = json.loads((folders["xlmr"] / "1_Pooling" / "config.json").read_text())
    assert pooling["pooling_mode_mean_tokens"] and not pooling["pooling_mode_cls_token"]
    assert json.loads((folders["bert"] / "1_Pooling" / "config.json").read_text())["pooling_mode_cls_token"]
    assert (folders["bert"] / "2_Normalize").is_dir() and not (folders["bert-1"] / "modules.json").exists()
