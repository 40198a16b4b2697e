"""A random folder in Qwen3-0.6B's real shape (worker/models/shaped.py) is what a user downloads, and
the worker's engine path loads it and matches transformers token for token."""
import gc
import json
import logging

import torch
from safetensors import safe_open

from shared.settings import WorkerSettings
from worker.engine.tokenizer import load_tokenizer, render_chat
from worker.engine.types import SamplingParams
from worker.main import build_engine
from worker.models.config import read_model_config

BLOCK_BYTES = 16 * 2 * 28 * 8 * 128 * 4  # 16 tokens of K and V, 28 layers, 8 KV heads of 128, fp32


def test_the_folder_has_qwen3_06bs_shape(qwen3_06b_dir):
    cfg = read_model_config(qwen3_06b_dir)
    assert (cfg.arch, cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.max_position_embeddings, cfg.rope_theta) == \
        ("qwen3", 151_936, 1024, 28, 16, 8, 128, 3072, 40_960, 1e6)
    assert cfg.tie_word_embeddings and cfg.dtype == "bfloat16"
    weight_map = json.loads((qwen3_06b_dir / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) == 4 and "lm_head.weight" not in weight_map
    with safe_open(str(qwen3_06b_dir / shards[1]), "pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
    tokenizer = load_tokenizer(qwen3_06b_dir)
    assert len(tokenizer) == 151_936 and tokenizer.eos_token_id == 151_645
    assert tokenizer.convert_ids_to_tokens([151_643, 151_644]) == ["<|endoftext|>", "<|im_start|>"]
    assert tokenizer.decode(tokenizer.encode("Hello world")) == "Hello world"


@torch.inference_mode()
def test_it_loads_through_the_worker_and_greedy_matches_transformers_in_fp32(qwen3_06b_dir, caplog):
    settings = WorkerSettings(model=str(qwen3_06b_dir), device="cpu", dtype="float32", max_num_seqs=4,
                              kv_cache_memory=18 * BLOCK_BYTES)
    with caplog.at_level(logging.WARNING, logger="kvgate.worker"):
        engine = build_engine(settings)
    assert engine.max_model_len == 288
    assert any("lowered from 40960 to 288 tokens" in r.getMessage() for r in caplog.records)
    prompt = render_chat(engine.tokenizer, [{"role": "user", "content": "Hello, how are you?"}])
    engine.add_request("r", prompt, SamplingParams(max_tokens=8, temperature=0.0))
    ours = []
    while engine.has_unfinished():
        ours += [t for out in engine.step() for t in out.new_token_ids]
    del engine
    gc.collect()
    assert ours == _transformers_greedy(qwen3_06b_dir, prompt, 8)
    assert len(set(ours)) > 3  # a model that echoes one token would match trivially


def _transformers_greedy(model_dir, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         pad_token_id=model.config.pad_token_id)
    return out[0, len(prompt):].tolist()

