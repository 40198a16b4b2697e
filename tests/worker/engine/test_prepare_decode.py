"""The decode step's plan (`_prepare_decode`: list arithmetic) is `_prepare_any`'s (torch ops), field
for field and dtype for dtype, on every one-token-per-sequence step of a varied workload: prompts
of many lengths across block boundaries, n > 1 sharing blocks, a shared prefix from the cache,
prompt logprobs asked for, chunked prefills whose last chunk is one token."""
from __future__ import annotations

import dataclasses

import torch

from worker.engine.llm import LLM
from worker.engine.types import SamplingParams


def _same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    else:
        assert a == b, where


def test_the_decode_plan_is_the_general_plan(build_tiny, random_prompts):
    llm = LLM(build_tiny("prepare-decode"), block_size=4, max_num_batched_tokens=37)
    runner = llm.engine.runner
    fast, compared = runner._prepare_decode, []

    def checked(batch):
        plan = fast(batch)
        _same(plan, runner._prepare_any(batch), "plan")
        compared.append(len(batch))
        return plan

    runner._prepare_decode = checked
    shared = random_prompts(1, 9, 9, seed=5)[0]
    prompts = random_prompts(10, 1, 30, seed=4) + [shared + p for p in random_prompts(4, 1, 7, seed=6)]
    params = [SamplingParams(max_tokens=12 + i % 9, temperature=0.0, ignore_eos=True, n=1 + (i % 3 == 0),
                             prompt_logprobs=1 if i % 4 == 1 else None) for i in range(len(prompts))]
    results = llm.generate(prompts, params)
    assert all(len(c.token_ids) == p.max_tokens for r, p in zip(results, params) for c in r.outputs)
    assert len(compared) >= 10 and max(compared) > 1
