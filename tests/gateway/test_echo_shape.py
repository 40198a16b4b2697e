"""A completion's echo as a resumed stream rebuilds it (gateway/openai_api.py `_Echo`): one prompt's is
written in the previous release's shape, which a gateway of that release reads, and every choice echoes
that prompt; a batch's names each choice's prompt."""
from __future__ import annotations

from gateway.openai_api import _Echo
from shared import protocol

SCORES = [{"token_id": 1, "token": "a", "logprob": None}]


def test_one_prompts_echo_is_written_as_before_and_every_choice_echoes_it():
    spec = _Echo(["Once"], with_logprobs=True).spec()
    assert spec == {"text": "Once", "with_logprobs": True, "vllm_field": False}  # the previous release's keys
    echo = _Echo.from_spec(spec)
    echo.scored(protocol.Delta(request_id="r", seq=2, index=0, prompt_logprobs=SCORES))
    assert [echo.text_of(i, "!") for i in range(3)] == ["Once!"] * 3
    assert echo.logprobs(2, []) == SCORES


def test_a_batchs_echo_names_each_choices_prompt_and_a_workers_text_is_heard():
    echo = _Echo.from_spec(_Echo(["a", "b"], per=2).spec())
    assert [echo.text(i) for i in range(4)] == ["a", "a", "b", "b"]
    echo.scored(protocol.Delta(request_id="r", seq=2, index=2, prompt_logprobs=SCORES))
    assert echo.scores == {1: SCORES}
    tokens = _Echo.from_spec(_Echo(text_from_worker=True, per=1).spec())
    assert tokens.text_of(0, "x") == "x"  # nothing heard yet
    tokens.heard(protocol.Delta(request_id="r", seq=1, prompt_texts=["p0", "p1"]))
    assert [tokens.text(i) for i in range(2)] == ["p0", "p1"]
