"""HFEngine on a tiny random Llama: matches transformers generate, stops and aborts correctly."""
from collections import defaultdict

import pytest
import torch

from worker.engine.hf_engine import HFEngine
from worker.engine.types import EngineRejected, SamplingParams
from worker.models.demo import build_model_dir

torch.set_num_threads(1)
PROMPTS = ["The cache block", "你好 model token 😀"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_model_dir(
        tmp_path_factory.mktemp("tiny"), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=128, max_position_embeddings=128,
    )
    return HFEngine.from_model_dir(path)


def run(engine, already=()) -> dict:
    """Step until idle; per (request id, choice index): output ids, text, reason, logprobs."""
    done = defaultdict(lambda: {"ids": [], "text": "", "reason": None, "logprobs": []})
    steps = [list(already)]
    while engine.has_unfinished():
        steps.append(engine.step())
    for step in steps:
        for out in step:
            d = done[(out.request_id, out.index)]
            assert d["reason"] is None, "nothing may follow a finished output"
            d["ids"] += out.new_token_ids
            d["text"] += out.text
            d["reason"] = out.finish_reason
            d["logprobs"] += out.logprobs or []
            assert out.num_output_tokens == len(d["ids"])
    return done


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def prompt_ids(engine, text):
    return engine.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", PROMPTS)
def test_greedy_matches_transformers_generate(engine, text):
    ids = prompt_ids(engine, text)
    engine.add_request("r", ids, greedy(max_tokens=12))
    got = run(engine)[("r", 0)]
    ref = engine.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert got["ids"] == ref[0, len(ids):].tolist()
    assert got["text"] == engine.tokenizer.decode(got["ids"], skip_special_tokens=True)


def test_max_tokens_finishes_with_length(engine):
    engine.add_request("r", prompt_ids(engine, PROMPTS[0]), greedy(max_tokens=5, ignore_eos=True))
    got = run(engine)[("r", 0)]
    assert got["reason"] == "length" and len(got["ids"]) == 5


def test_stop_string_finishes_with_stop_and_cuts_the_text(engine):
    ids = prompt_ids(engine, PROMPTS[0])
    engine.add_request("full", ids, greedy(max_tokens=20, ignore_eos=True))
    full = run(engine)[("full", 0)]["text"]
    assert len(full) >= 8, f"the tiny model should say something: {full!r}"
    stop = full[4:7]
    for include in (False, True):
        engine.add_request("s", ids, greedy(max_tokens=20, ignore_eos=True, stop=[stop],
                                            include_stop_str_in_output=include))
        got = run(engine)[("s", 0)]
        cut = full.find(stop) + (len(stop) if include else 0)
        assert got["reason"] == "stop" and got["text"] == full[:cut]


def test_a_stop_string_ends_nothing_within_min_tokens(engine):
    assert engine.tokenizer.decode([67]) == "a"
    engine.add_request("m", prompt_ids(engine, PROMPTS[0]),
                       greedy(max_tokens=8, stop=["a"], min_tokens=5, logit_bias={67: 100.0}))
    got = run(engine)[("m", 0)]
    assert (got["text"], got["reason"], len(got["ids"])) == ("aaaaa", "stop", 6)


def test_stop_token_id_finishes_without_its_text(engine):
    ids = prompt_ids(engine, PROMPTS[0])
    engine.add_request("full", ids, greedy(max_tokens=6, ignore_eos=True))
    full = run(engine)[("full", 0)]["ids"]
    engine.add_request("s", ids, greedy(max_tokens=6, ignore_eos=True, stop_token_ids=[full[2]]))
    got = run(engine)[("s", 0)]
    first = full.index(full[2])
    assert got["reason"] == "stop" and got["ids"] == full[: first + 1]
    assert got["text"] == engine.tokenizer.decode(full[:first], skip_special_tokens=True)


def test_abort_running_and_waiting_requests(engine):
    ids = prompt_ids(engine, PROMPTS[0])
    for rid in ("a", "b", "c"):
        engine.add_request(rid, ids, greedy(max_tokens=8, ignore_eos=True))
    assert engine.free_capacity() == 0 and engine.stats()["num_waiting"] == 3
    first = engine.step()
    assert engine.stats()["num_running"] == 1 and engine.stats()["num_waiting"] == 2
    engine.abort("a")
    engine.abort("c")
    got = run(engine, first)
    assert got[("a", 0)]["reason"] == "abort" and len(got[("a", 0)]["ids"]) == 1
    assert got[("c", 0)]["reason"] == "abort" and got[("c", 0)]["ids"] == []
    assert got[("b", 0)]["reason"] == "length" and len(got[("b", 0)]["ids"]) == 8
    assert engine.free_capacity() == 1 and not engine.has_unfinished()


def test_greedy_logprobs_match_transformers_logits(engine):
    ids = prompt_ids(engine, PROMPTS[1])
    engine.add_request("r", ids, greedy(max_tokens=6, logprobs=3, ignore_eos=True))
    got = run(engine)[("r", 0)]
    with torch.inference_mode():
        logits = engine.model(torch.tensor([ids + got["ids"]])).logits[0]
    ref = torch.log_softmax(logits.float(), -1)[len(ids) - 1: -1]
    for step, lp in enumerate(got["logprobs"]):
        assert lp.token_id == got["ids"][step] == ref[step].argmax().item()
        assert abs(lp.logprob - ref[step, lp.token_id].item()) < 1e-4
        assert [t for t, _ in lp.top] == ref[step].topk(3).indices.tolist()
    assert len(got["logprobs"]) == 6


def test_n_choices_run_one_after_another_with_their_own_seeded_streams(engine):
    ids = prompt_ids(engine, PROMPTS[0])
    params = SamplingParams(max_tokens=6, seed=3, n=2, ignore_eos=True)
    engine.add_request("r", ids, params)
    first = run(engine)
    engine.add_request("r", ids, params)
    again = run(engine)
    assert set(first) == {("r", 0), ("r", 1)}
    assert first[("r", 0)]["ids"] != first[("r", 1)]["ids"]
    assert [first[k]["ids"] for k in sorted(first)] == [again[k]["ids"] for k in sorted(again)]


def test_too_long_requests_are_rejected_with_numbers(engine):
    with pytest.raises(EngineRejected, match="120.*16.*128"):
        engine.add_request("r", [5] * 120, SamplingParams(max_tokens=16))
    assert not engine.has_unfinished()


def test_stats_have_the_paged_engine_keys(engine):
    assert set(engine.stats()) == {"num_running", "num_waiting", "kv_usage", "prefix_cache_queries",
                                   "prefix_cache_hits", "num_preemptions"}
    assert engine.max_model_len == 128 and engine.eos_token_ids == {engine.tokenizer.eos_token_id}
