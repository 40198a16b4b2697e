"""A failure stays with its request: the three engines refuse the same out-of-range input with the
same words, and on a real engine a request whose sampling, detokenizing or forward pass raises ends
alone (or, for a forward pass, with its step's requests and a retryable code) while the rest of the
batch and the next requests are served token-exact with transformers."""
from __future__ import annotations

import math

import pytest
import torch

from shared.settings import WorkerSettings
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.tokenizer import render_chat
from worker.engine.types import EngineRejected, SamplingParams
from worker.main import build_engine

torch.set_num_threads(1)
MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
ENGINES = ("paged", "hf", "synthetic")


@pytest.fixture(scope="module")
def model_dir(build_tiny):
    return build_tiny("exact-llama")


def engine_of(model_dir, kind: str):
    return build_engine(WorkerSettings(model=str(model_dir), engine=kind, device="cpu",
                                       kv_cache_memory=8 << 20))


@pytest.fixture(scope="module")
def engines(model_dir):
    return {kind: engine_of(model_dir, kind) for kind in ENGINES}


def run(engine) -> dict[str, dict]:
    """Step until idle; per request: its token ids (choice 0), finish reason and error."""
    done: dict[str, dict] = {}
    while engine.has_unfinished():
        for out in engine.step():
            d = done.setdefault(out.request_id, {"ids": [], "reason": None, "error": None})
            d["ids"] += out.new_token_ids
            if out.finished:
                d["reason"], d["error"] = out.finish_reason, out.error
    return done


def allow_anything(monkeypatch, engine) -> None:
    """Switch the admission check off, as a worker without it was: the crash must reach the engine."""
    monkeypatch.setattr(engine, "check_request",
                        lambda prompt, params, resume=None: len(prompt) + params.max_tokens)


REFUSED = [  # (prompt, params, words the refusal must contain, error code, param)
    ([10000000], GREEDY, "prompt token id 10000000 at position 0 is outside this model's vocabulary "
     "[0, 2048)", "invalid_request", "prompt"),
    ([1, -7], GREEDY, "prompt token id -7 at position 1 is outside", "invalid_request", "prompt"),
    ([5, 6], SamplingParams(max_tokens=4, stop_token_ids=[3, 99999999], min_tokens=1),
     "stop_token_ids value 99999999 at position 1 is outside this model's vocabulary [0, 2048)",
     "invalid_request", "stop_token_ids"),
    ([5], SamplingParams(max_tokens=4, logprobs=-1), "logprobs must be between 0 and the vocabulary "
     "size (2048); got -1", "invalid_request", "logprobs"),
    ([5], SamplingParams(max_tokens=4, logprobs=5000), "logprobs must be between", "invalid_request",
     "logprobs"),
    ([5], SamplingParams(max_tokens=4, top_k=-5), "top_k must be", "invalid_request", "top_k"),
    ([5], SamplingParams(max_tokens=4, min_tokens=5), "min_tokens must be between 0 and max_tokens "
     "(4); got 5", "invalid_request", "min_tokens"),
    ([5], SamplingParams(max_tokens=4, n=0), "n must be between 1 and 16; got 0", "invalid_request", "n"),
    ([5], SamplingParams(max_tokens=4, n=17), "n must be between 1 and 16; got 17", "invalid_request", "n"),
    ([5], SamplingParams(max_tokens=4, temperature=math.nan), "temperature must be a finite number",
     "invalid_request", "temperature"),
    ([5], SamplingParams(max_tokens=4, top_p=0.0), "top_p must be in (0, 1]", "invalid_request", "top_p"),
    ([5], SamplingParams(max_tokens=4, repetition_penalty=0.0), "repetition_penalty must be greater "
     "than 0", "invalid_request", "repetition_penalty"),
    ([5], SamplingParams(max_tokens=-1), "max_tokens must be 0 (the prompt scored, nothing generated) or more",
     "invalid_request", "max_tokens"),
    ([], GREEDY, "the prompt has 0 tokens", "invalid_request", "prompt"),
    ([5] * 200, SamplingParams(max_tokens=4000), "exceeds max_model_len", "context_length_exceeded", None),
]


@pytest.mark.parametrize("prompt, params, words, code, param", REFUSED)
def test_every_engine_refuses_the_same_input_with_the_same_words(engines, prompt, params, words,
                                                                   code, param):
    refusals = {}
    for kind, engine in engines.items():
        with pytest.raises(EngineRejected) as caught:
            engine.add_request(f"bad-{kind}", prompt, params)
        refusals[kind] = (str(caught.value), caught.value.code, caught.value.param)
        assert not engine.has_unfinished()
    assert len(set(refusals.values())) == 1, refusals
    message, got_code, got_param = refusals["paged"]
    assert words in message and got_code == code and got_param == param


def test_a_resumed_token_outside_the_vocabulary_is_a_failed_resume(engines):
    from worker.engine.types import Resume

    for engine in engines.values():
        with pytest.raises(EngineRejected, match="token id resumed for choice 0 5000 at position 1") as c:
            engine.add_request("r", [5, 6], GREEDY, Resume(output_ids={0: [7, 5000]}))
        assert c.value.code == "resume_failed"


def test_the_registry_facts_of_every_engine_agree(engines):
    facts = {kind: (e.vocab_size, e.max_model_len, sorted(e.eos_token_ids), e.bos_token_id)
             for kind, e in engines.items()}
    assert len(set(map(str, facts.values()))) == 1, facts
    assert facts["paged"][0] == 2048 and facts["paged"][2]


def test_a_chat_template_that_raises_refuses_the_request(model_dir, engines):
    tok = engines["paged"].tokenizer
    original = tok.chat_template
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}"
                         "{{ m['content'] }}{% endfor %}")
    try:
        assert render_chat(tok, [{"role": "user", "content": "hi"}])
        with pytest.raises(EngineRejected, match="the model's chat template refused these messages: "
                                                 "System role not supported") as caught:
            render_chat(tok, [{"role": "system", "content": "x"}])
        assert caught.value.code == "invalid_request" and caught.value.param == "messages"
        with pytest.raises(EngineRejected, match="chat template refused"):  # a syntax error is one too
            tok.chat_template = "{% for m in messages %}{{ m['content'] }"
            render_chat(tok, [{"role": "user", "content": "hi"}])
    finally:
        tok.chat_template = original


@pytest.fixture(scope="module")
def expected(model_dir, random_prompts, hf_greedy):
    prompts = random_prompts(5, 3, 30, seed=7)
    return prompts, hf_greedy(model_dir, prompts, MAX_NEW)


def test_a_request_whose_sampling_raises_fails_alone_in_its_batch(model_dir, expected, monkeypatch):
    """The real poison of issue 14: an out-of-vocab stop id under min_tokens raised IndexError in the
    batched sampler's early-stop mask. Row by row, only its row raises."""
    prompts, want = expected
    engine = engine_of(model_dir, "paged")
    allow_anything(monkeypatch, engine)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    engine.add_request("poison", prompts[0], SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                            stop_token_ids=[99999999], min_tokens=1))
    done = run(engine)
    assert done["poison"]["reason"] == "error" and done["poison"]["ids"] == []
    assert done["poison"]["error"].code == "request_failed" and not done["poison"]["error"].retryable
    assert "IndexError" in done["poison"]["error"].message
    assert [done[str(i)]["ids"] for i in range(len(prompts))] == want
    assert all(done[str(i)]["error"] is None for i in range(len(prompts)))
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"]


@pytest.mark.parametrize("kind", ["paged", "hf"])
def test_a_request_whose_detokenizing_raises_fails_alone(model_dir, expected, kind, monkeypatch):
    prompts, want = expected
    add = IncrementalDetokenizer.add

    def add_or_raise(self, token_ids):  # a test-only fault: the stop string "boom" breaks detokenizing
        if "boom" in self.stop:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return add(self, token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "add", add_or_raise)
    engine = engine_of(model_dir, kind)
    engine.add_request("a", prompts[1], GREEDY)
    engine.add_request("poison", prompts[0], SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                            stop=["boom"], n=2))
    engine.add_request("b", prompts[2], GREEDY)
    done = run(engine)
    assert done["poison"]["reason"] == "error" and done["poison"]["error"].code == "request_failed"
    assert "UnicodeDecodeError" in done["poison"]["error"].message
    assert [done["a"]["ids"], done["b"]["ids"]] == want[1:3]
    assert not engine.has_unfinished()
    if kind == "paged":
        assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"]


@pytest.mark.parametrize("kind", ["paged", "hf"])
def test_a_forward_pass_that_raises_fails_its_step_retryably_and_the_engine_goes_on(
        model_dir, expected, kind, monkeypatch):
    """An id past the embedding raises inside the batched forward pass (what killed the worker):
    nothing says which request caused it, so the step's requests end with engine_step_failed, the
    engine keeps no half-written block in its prefix cache, and the next requests run exactly."""
    prompts, want = expected
    engine = engine_of(model_dir, kind)
    allow_anything(monkeypatch, engine)
    engine.add_request("0", prompts[0], GREEDY)
    engine.add_request("poison", [5, 10000000, 7], GREEDY)
    engine.add_request("1", prompts[1], GREEDY)
    first = run(engine)
    failed = {rid for rid, d in first.items() if d["error"] is not None}
    assert "poison" in failed
    for rid in failed:
        assert first[rid]["reason"] == "error" and first[rid]["error"].code == "engine_step_failed"
        assert first[rid]["error"].retryable and "IndexError" in first[rid]["error"].message
    if kind == "paged":  # one step held all three prompts
        assert failed == {"0", "poison", "1"}
        assert not engine.pool.cached, "no block of the failed step may stay in the prefix cache"
        assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"]
    else:  # one request per step: only the poison's failed
        assert failed == {"poison"} and [first["0"]["ids"], first["1"]["ids"]] == want[:2]
    for i, p in enumerate(prompts):  # sent again (retryable), and new ones: all exact
        engine.add_request(f"again-{i}", p, GREEDY)
    again = run(engine)
    assert [again[f"again-{i}"]["ids"] for i in range(len(prompts))] == want
