"""The paged engine is token-exact with transformers (fp32 greedy) however it batches, chunks,
caches or preempts: Llama, Qwen2 and Qwen3."""
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from worker.engine.llm import LLM
from worker.engine.types import SamplingParams

torch.set_num_threads(1)
MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


@dataclass
class Case:
    model_dir: Path
    prompts: list[list[int]]
    expected: list[list[int]]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def case(request, build_tiny, random_prompts, hf_greedy) -> Case:
    extra = {"head_dim": 32} if request.param == "qwen3" else {}  # Qwen3: head_dim from config, not hidden/heads
    model_dir = build_tiny(f"exact-{request.param}", request.param, **extra)
    prompts = random_prompts(16, 3, 60, seed=1)
    return Case(model_dir, prompts, hf_greedy(model_dir, prompts, MAX_NEW))


def tokens(results) -> list[list[int]]:
    return [r.token_ids for r in results]


def test_single_request(case):
    llm = LLM(case.model_dir)
    assert tokens(llm.generate(case.prompts[:1], GREEDY)) == case.expected[:1]


def test_sixteen_at_once_then_again_from_the_prefix_cache(case):
    llm = LLM(case.model_dir)
    assert tokens(llm.generate(case.prompts, GREEDY)) == case.expected
    hits_before = llm.engine.stats()["prefix_cache_hits"]
    assert tokens(llm.generate(case.prompts, GREEDY)) == case.expected
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] > hits_before
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_tiny_token_budget_forces_chunked_prefill(case):
    llm = LLM(case.model_dir, max_num_batched_tokens=8, block_size=4)
    assert tokens(llm.generate(case.prompts, GREEDY)) == case.expected


def test_small_pool_forces_preemption(case):
    llm = LLM(case.model_dir, num_blocks=12, block_size=8, max_num_batched_tokens=64)
    assert tokens(llm.generate(case.prompts, GREEDY)) == case.expected
    assert llm.engine.stats()["num_preemptions"] > 0


def test_n_choices_share_the_prompt_blocks(case):
    llm = LLM(case.model_dir, block_size=4)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, n=3)
    long_prompt = max(case.prompts, key=len)
    result = llm.generate([long_prompt], params)[0]
    expected = case.expected[case.prompts.index(long_prompt)]
    assert [c.token_ids for c in result.outputs] == [expected] * 3
    assert llm.engine.stats()["prefix_cache_hits"] >= 2 * ((len(long_prompt) - 1) // 4 * 4)


def test_priorities_and_preemption_keep_outputs_exact(case):
    llm = LLM(case.model_dir, num_blocks=16, block_size=8, max_num_seqs=6)
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, priority=i % 3) for i in range(16)]
    assert tokens(llm.generate(case.prompts, params)) == case.expected


def test_pure_torch_backend_is_exact_too(case):
    llm = LLM(case.model_dir, attention_backend="torch", max_num_batched_tokens=32)
    assert tokens(llm.generate(case.prompts, GREEDY)) == case.expected


def test_slots_yielded_to_the_fair_order_keep_outputs_exact(case):
    """The worker's fair order makes a tenant yield a slot mid-generation (preemption by recompute):
    each yield frees one unit of room at once, and every output is still token-exact."""
    llm = LLM(case.model_dir, max_num_seqs=4, max_num_batched_tokens=64)
    engine, got = llm.engine, {}
    waiting = [(str(i), p) for i, p in enumerate(case.prompts)]
    step = 0
    while waiting or engine.has_unfinished():
        while waiting and engine.free_capacity() > 0:
            rid, prompt = waiting.pop(0)
            engine.add_request(rid, prompt, GREEDY)
            got[rid] = []
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        step += 1
        running = engine.running_requests()
        if step % 3 == 0 and len(running) == 4 and waiting and not engine.scheduler.waiting:
            room = engine.free_capacity()
            assert engine.yield_slot({running[-1]}, priority=0)
            assert engine.free_capacity() == room + 1
            assert len(engine.running_requests()) == 3
    assert [got[str(i)] for i in range(len(case.prompts))] == case.expected
    assert engine.stats()["num_fair_preemptions"] > 0


def test_fork_branches_sent_together_share_the_prefix_prefill_and_stay_exact(case, hf_greedy):
    """Four prompts with one 48-token prefix sent at once to a 16-token budget: the first prefills
    the prefix chunk by chunk, the others wait for it and read it from the cache; outputs exact."""
    prefix = [t for p in case.prompts for t in p][:48]
    prompts = [prefix + [7 + i, 11 + i, 13 + i] for i in range(4)]
    llm = LLM(case.model_dir, block_size=4, max_num_batched_tokens=16)
    assert tokens(llm.generate(prompts, GREEDY)) == hf_greedy(case.model_dir, prompts, MAX_NEW)
    assert llm.engine.stats()["prefix_cache_hits"] >= 3 * 48
