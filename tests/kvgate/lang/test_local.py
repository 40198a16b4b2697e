"""The language on the in-process engine: select against transformers, constraints that always
hold, control flow, forks, streaming, and errors that name their step."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from kvgate.lang import ProgramError, assistant, function, gen, select, set_default_backend, system, user

WORDS = ["red", "blue", "cat", "dog", "sky", "tree", "river", "stone", "bright", "quiet", "seven", "north"]


@function
def pick(s, state, choices):
    s += state
    s += select("pick", choices)


def test_select_is_transformers_argmax_of_normalised_logprobs(local, reference_select):
    rng = random.Random(7)
    cases = [(" ".join(rng.choices(WORDS, k=rng.randint(4, 30))),
              [" " + " ".join(rng.choices(WORDS, k=rng.randint(1, 3))) for _ in range(rng.randint(2, 4))])
             for _ in range(20)]
    states = pick.run_batch([{"state": st, "choices": ch} for st, ch in cases], backend=local, max_concurrency=4)
    for (st, choices), s in zip(cases, states):
        ref = reference_select(st, choices)
        assert s["pick"] == choices[max(range(len(ref)), key=ref.__getitem__)]
        assert sorted(range(len(ref)), key=lambda i: -ref[i]) == sorted(range(len(ref)), key=lambda i: -s.scores["pick"][i])
        assert s.scores["pick"] == pytest.approx(ref, abs=1e-4)


# values of bounded length: a random model would otherwise write digits until max_tokens
SCHEMA = {"type": "object", "properties": {"size": {"enum": ["S", "M", "L"]}, "ok": {"type": "boolean"}},
          "required": ["size", "ok"], "additionalProperties": False}


@function
def constrained(s, seed):
    s += "Code: "
    s += gen("code", max_tokens=12, regex=r"[A-Z]{3}-[0-9]{2,4}", seed=seed)
    s += "\nRecord: "
    s += gen("record", max_tokens=60, seed=seed, json_schema=SCHEMA)
    s += "\nColour: "
    s += gen("colour", choices=["red", "green", "blue"], seed=seed)




def test_regex_always_matches_and_json_always_validates(local):
    for s in constrained.run_batch([{"seed": i} for i in range(6)], backend=local, max_concurrency=6):
        assert re.fullmatch(r"[A-Z]{3}-[0-9]{2,4}", s["code"])
        jsonschema.validate(json.loads(s["record"]), SCHEMA)
        assert s["colour"] in ("red", "green", "blue")
        assert s.text().endswith(s["colour"])


@function
def chat_loop(s, turns):
    s += system("You count.")
    for i in range(turns):
        s += user(f"Turn {i}?")
        s += assistant(gen(f"a{i}", max_tokens=3, temperature=0))
        if s[f"a{i}"] == "":  # a branch on a generated value
            s += "(empty)"
    s += select("verdict", [" done", " again"])


def test_loops_branches_and_chat_markers(local):
    s = chat_loop.run(turns=3, backend=local)
    text = s.text()
    assert text.startswith("<|im_start|>system\nYou count.<|im_end|>\n<|im_start|>user\nTurn 0?<|im_end|>\n")
    assert text.count("<|im_start|>assistant\n") == 3 and all(f"a{i}" in s.variables for i in range(3))
    assert s["verdict"] in (" done", " again")


@function
def branches(s, fail_branch):
    s += "Shared prefix " * 8
    forks = s.fork(4)
    for i, f in enumerate(forks):
        f += f"branch {i}:"
        f += gen("x", max_tokens=4, seed=i, regex="[a-z]+" if i != fail_branch else "(")
    forks.join()
    s["forks"] = [f["x"] for f in forks]


def test_fork_branches_run_and_a_failed_branch_fails_its_join(local):
    ok = branches.run(fail_branch=-1, backend=local)
    assert len(ok["forks"]) == 4 and all(re.fullmatch("[a-z]+", x) for x in ok["forks"])
    assert "branch" not in ok.text()  # the forks' text stays theirs
    with pytest.raises(ProgramError) as failed:
        branches.run(fail_branch=2, backend=local)
    assert failed.value.step == "fork 2: gen 'x'" and "regex" in failed.value.message.lower()


def test_stream_a_named_variable(local):
    @function
    def story(s):
        s += "Once"
        s += gen("story", max_tokens=8, temperature=0)

    state = story.run(backend=local, stream=True)
    pieces = list(state.text_iter("story"))
    assert "".join(pieces) == state["story"] and len(pieces) >= 1


def test_default_backend_and_engine_refusals_name_the_step(local):
    set_default_backend(local)
    try:
        @function
        def too_long(s):
            s += "x"
            s += gen("answer", max_tokens=10**7)

        with pytest.raises(ProgramError, match="gen 'answer': .*max_model_len") as err:
            too_long.run()
        assert err.value.status == 400
    finally:
        set_default_backend(None)
    with pytest.raises(ValueError, match="no backend"):
        too_long.run()


@function
def fan_out(s, state):
    s += state
    forks = s.fork(3)
    forks += gen("x", max_tokens=2, seed=1)
    forks.join()


def test_a_fork_of_a_long_state_prefills_it_once_before_its_branches(local, monkeypatch):
    from kvgate.lang.state import PREFILL_BEFORE_FORK_CHARS

    sent, real = [], local.generate

    def recording(prompt, params, on_text=None):
        sent.append((len(prompt), params.get("max_tokens")))
        return real(prompt, params, on_text)
    monkeypatch.setattr(local, "generate", recording)
    long = "stone river " * (PREFILL_BEFORE_FORK_CHARS // 12 + 1)
    fan_out.run(state=long, backend=local)
    assert sent[0] == (len(long), 1) and len(sent) == 4  # the state alone first, then 3 branches
    sent.clear()
    fan_out.run(state="short", backend=local)
    assert sent == [(len("short"), 2)] * 3  # the branches only: a short state is not worth a round trip
