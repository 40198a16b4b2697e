"""A batched completion without max_tokens runs each prompt's choices to the end of the context (vLLM's
per-prompt default), on each of the three engines: a short prompt is not held to the room the
batch's longest prompt leaves, the room the request was checked with."""
from __future__ import annotations

import pytest

from shared.settings import WorkerSettings
from worker.engine.types import SamplingParams
from worker.main import build_engine

CONTEXT = 64


@pytest.mark.parametrize("kind", ["paged", "hf", "synthetic"])
def test_each_prompt_runs_to_its_own_end_of_the_context(build_tiny, kind):
    engine = build_engine(WorkerSettings(model=str(build_tiny("exact-llama")), engine=kind, device="cpu",
                                         kv_cache_memory=8 << 20, max_model_len=CONTEXT))
    short, long = [11] * 10, [12] * 50
    room = SamplingParams(max_tokens=CONTEXT - len(long), temperature=0.0, ignore_eos=True, n=2)
    engine.add_request("to-context", [short, long], room, to_context=True)
    engine.add_request("as-set", [short, long], room)
    tokens: dict[tuple[str, int], int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            key = (out.request_id, out.index)
            tokens[key] = tokens.get(key, 0) + len(out.new_token_ids)
            assert out.error is None and (not out.finished or out.finish_reason == "length")
    assert [tokens["to-context", i] for i in range(4)] == [CONTEXT - 10] * 2 + [CONTEXT - 50] * 2
    assert [tokens["as-set", i] for i in range(4)] == [CONTEXT - 50] * 4
