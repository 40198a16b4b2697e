"""The paged engine on the `triton` backend (interpreted on CPU) greedy-decodes like transformers."""
from __future__ import annotations

import pytest
import torch

from worker.engine.types import SamplingParams

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from worker.models.demo import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("tiny-triton"), **TINY)


def _run(engine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    got = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    return got


@torch.inference_mode()
def _hf_greedy(model_dir, prompt: list[int], max_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_matches_transformers_with_chunks_and_a_prefix_hit(tiny_dir, device):
    engine_mod = pytest.importorskip("worker.engine.engine")
    engine = engine_mod.LLMEngine.from_model_dir(
        tiny_dir, device=device, dtype="float32", attention_backend="triton", block_size=4, num_blocks=48,
        max_num_batched_tokens=12)  # 12-token budget: prompts are prefilled in chunks beside decodes
    assert engine.runner.backend.name == "triton"
    shared = [7, 300, 41, 1200, 99, 5, 640, 18]  # two full blocks of 4
    first = {"a": shared + [11, 12, 13], "b": [900, 3, 17, 250, 60, 61, 62, 63, 64, 65, 66, 67, 68]}
    second = {"c": shared + [500, 501]}  # added after "a" finished: its first 8 tokens hit the cache
    got = _run(engine, first, max_tokens=5)
    got |= _run(engine, second, max_tokens=5)
    assert engine.stats()["prefix_cache_hits"] > 0
    for rid, prompt in (first | second).items():
        assert got[rid] == _hf_greedy(tiny_dir, prompt, 5), rid
