"""The paged engine on the `triton` backend (interpreted on CPU) greedy-decodes like transformers,
eagerly and through the decode graphs' padded static buffers."""
from __future__ import annotations

import pytest
import torch

from worker.engine.types import SamplingParams

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from worker.models.demo import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("tiny-triton"), **TINY)


def _engine(model_dir, device, **flags):
    from worker.engine.engine import LLMEngine

    return LLMEngine.from_model_dir(model_dir, device=device, dtype="float32", attention_backend="triton",
                                    block_size=4, num_blocks=48, **flags)


def _run(engine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    return _drain(engine, prompts)


def _drain(engine, request_ids) -> dict[str, list[int]]:
    got = {rid: [] for rid in request_ids}
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
    engine = _engine(tiny_dir, device, max_num_batched_tokens=12)  # prefill chunks beside decodes
    assert engine.runner.backend.name == "triton"
    shared = [7, 300, 41, 1200, 99, 5, 640, 18]  # two full blocks of 4
    first = {"a": shared + [11, 12, 13], "b": [900, 3, 17, 250, 60, 61, 62, 63, 64, 65, 66, 67, 68]}
    second = {"c": shared + [500, 501]}  # added after "a" finished: its first 8 tokens hit the cache
    got = _run(engine, first, max_tokens=5)
    got |= _run(engine, second, max_tokens=5)
    assert engine.stats()["prefix_cache_hits"] > 0
    for rid, prompt in (first | second).items():
        assert got[rid] == _hf_greedy(tiny_dir, prompt, 5), rid


# max_tokens 2..6: after the shared prefill step, decode batches of 5, 4, 3, 2, 1 rows
STAGGERED = {"a": [7, 300, 41], "b": [900, 3, 17, 250, 60], "c": [12, 13], "d": [44, 45, 46, 47, 48, 49, 50],
             "e": [1000, 2]}


def test_padded_decode_graph_path_matches_transformers(tiny_dir, device):
    engine = _engine(tiny_dir, device, pad_decode_eagerly=True)
    graphs = engine.runner.decode_graphs
    steps = []  # (bucket, live rows) of each decode step the graph path ran
    step = graphs.step

    def spy(inputs):
        steps.append((len(inputs["seq_lens"]), int(inputs["seq_lens"].count_nonzero())))
        return step(inputs)

    graphs.step = spy
    params = {rid: SamplingParams(max_tokens=2 + i, temperature=0.0, ignore_eos=True)
              for i, rid in enumerate(STAGGERED)}
    for rid, ids in STAGGERED.items():
        engine.add_request(rid, ids, params[rid])
    got = _drain(engine, STAGGERED)
    assert steps == [(8, 5), (4, 4), (4, 3), (2, 2), (1, 1)]  # padding rows have seq_len 0
    assert engine.runner.num_graph_steps == len(steps)
    for rid, prompt in STAGGERED.items():
        assert got[rid] == _hf_greedy(tiny_dir, prompt, params[rid].max_tokens), rid


def test_a_step_with_a_prefill_chunk_runs_eagerly(tiny_dir, device):
    engine = _engine(tiny_dir, device, pad_decode_eagerly=True)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.step()  # a's prefill
    engine.add_request("b", [8, 9, 10, 11], params)
    engine.step()  # a decodes beside b's prefill
    assert engine.runner.num_graph_steps == 0
    engine.step()  # both decode
    assert engine.runner.num_graph_steps == 1


def test_enforce_eager_builds_no_decode_graphs(tiny_dir, device):
    assert _engine(tiny_dir, device, enforce_eager=True, pad_decode_eagerly=True).runner.decode_graphs is None
