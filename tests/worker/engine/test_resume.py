"""A request resumed from the tokens it already sent continues exactly as if nothing happened."""
from __future__ import annotations

import pytest

from worker.engine.types import Resume, SamplingParams
from worker.main import build_engine
from shared.settings import WorkerSettings


def _run(engine, rid, prompt, params, resume=None) -> dict[int, tuple[list[int], str, str]]:
    engine.add_request(rid, prompt, params, resume)
    out: dict[int, tuple[list[int], str, str]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            ids, text, _ = out.get(o.index, ([], "", None))
            out[o.index] = (ids + o.new_token_ids, text + o.text, o.finish_reason)
    return out


@pytest.mark.parametrize("engine_kind", ["paged", "hf"])
@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True, n=2,
                   frequency_penalty=0.5),
])
def test_resume_continues_token_and_text_exact(tiny_model_dir, engine_kind, params):
    engine = build_engine(WorkerSettings(model=str(tiny_model_dir), engine=engine_kind, device="cpu",
                                         kv_cache_memory=8 << 20))
    prompt = engine.tokenizer("Resume me, café 😀 please")["input_ids"]
    whole = _run(engine, "whole", prompt, params)
    cut = {i: ids[:9] for i, (ids, _, _) in whole.items()}
    partial = _run(engine, "part", prompt, params, Resume(output_ids=cut))
    for i, (ids, text, reason) in whole.items():
        head_text = _released_text(engine, prompt, params, cut[i])
        assert cut[i] + partial[i][0] == ids
        assert head_text + partial[i][1] == text
        assert partial[i][2] == reason


def _released_text(engine, prompt, params, ids) -> str:
    from worker.engine.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(engine.tokenizer, prompt, params.stop, params.include_stop_str_in_output)
    return "".join(detok.add([t]) for t in ids)


def test_resume_skips_finished_choices(tiny_model_dir):
    engine = build_engine(WorkerSettings(model=str(tiny_model_dir), engine="paged", device="cpu",
                                         kv_cache_memory=8 << 20))
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, n=3)
    out = _run(engine, "r", [5, 6, 7], params, Resume(finished={0, 2}))
    assert set(out) == {1}
