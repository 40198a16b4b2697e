"""Model folders load the same in old and new config spellings, sharded or not, tied or not,
and RoPE scaling and tied embeddings still match transformers token for token."""
import json
import shutil

import pytest
import torch

from worker.engine.llm import LLM
from worker.engine.types import SamplingParams
from worker.models.config import read_model_config

torch.set_num_threads(1)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=32)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def to_old_spelling(src, dst):
    """Rewrite config.json as transformers 4.x wrote it: torch_dtype, rope_theta and rope_scaling."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw["torch_dtype"] = raw.pop("dtype")
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        raw["rope_scaling"] = {"type" if k == "rope_type" else k: v for k, v in rope.items()}
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("name,kw", [
    ("rope-llama3", dict(rope_scaling=LLAMA3, rope_theta=500000.0)),
    ("tied", dict(tie_word_embeddings=True)),
])
def test_matches_transformers(name, kw, build_tiny, random_prompts, hf_greedy):
    model_dir = build_tiny(name, **kw)
    prompts = random_prompts(4, 20, 70, seed=3)
    assert [r.token_ids for r in LLM(model_dir).generate(prompts, GREEDY)] == hf_greedy(model_dir, prompts, 16)


def test_old_spelling_reads_and_runs_the_same(tmp_path, build_tiny, random_prompts):
    new = build_tiny("rope-llama3", rope_scaling=LLAMA3, rope_theta=500000.0)
    old = to_old_spelling(new, tmp_path / "old")
    assert "rope_parameters" not in json.loads((old / "config.json").read_text())
    assert read_model_config(old) == read_model_config(new)
    assert read_model_config(old).rope_scaling["rope_type"] == "llama3"
    prompts = random_prompts(3, 10, 40, seed=4)
    assert [r.token_ids for r in LLM(old).generate(prompts, GREEDY)] == \
        [r.token_ids for r in LLM(new).generate(prompts, GREEDY)]


def test_sharded_checkpoint_loads_the_same(tmp_path, build_tiny, random_prompts):
    from transformers import AutoModelForCausalLM

    src = build_tiny("exact-qwen2", "qwen2")
    sharded = tmp_path / "sharded"
    shutil.copytree(src, sharded)
    (sharded / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(str(src)).save_pretrained(sharded, max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").exists()
    prompts = random_prompts(3, 10, 40, seed=5)
    assert [r.token_ids for r in LLM(sharded).generate(prompts, GREEDY)] == \
        [r.token_ids for r in LLM(src).generate(prompts, GREEDY)]


def test_config_fields(build_tiny):
    cfg = read_model_config(build_tiny("exact-qwen3", "qwen3", head_dim=32))
    assert (cfg.arch, cfg.head_dim, cfg.qk_norm, cfg.qkv_bias) == ("qwen3", 32, "head", False)
    cfg = read_model_config(build_tiny("exact-qwen2", "qwen2"))
    assert (cfg.arch, cfg.qkv_bias, cfg.o_bias, cfg.num_kv_heads, cfg.dtype) == ("qwen2", True, False, 2, "float32")


@pytest.mark.parametrize("sharded", [False, True])
def test_a_pytorch_bin_checkpoint_loads_the_same(tmp_path, sharded, build_tiny, random_prompts):
    """A folder with only pytorch_model*.bin (older checkpoints), whole or sharded with an index."""
    from safetensors.torch import load_file

    src = build_tiny("exact-qwen2", "qwen2")
    old = tmp_path / "bin"
    shutil.copytree(src, old)
    (old / "model.safetensors").unlink()
    tensors = load_file(src / "model.safetensors")
    if not sharded:
        torch.save(tensors, old / "pytorch_model.bin")
    else:
        names = sorted(tensors)
        halves = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
        for file, part in halves.items():
            torch.save({name: tensors[name] for name in part}, old / file)
        index = {"weight_map": {name: file for file, part in halves.items() for name in part}}
        (old / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    prompts = random_prompts(3, 10, 40, seed=6)
    assert [r.token_ids for r in LLM(old).generate(prompts, GREEDY)] == \
        [r.token_ids for r in LLM(src).generate(prompts, GREEDY)]
