"""Every bound of gateway/bounds.py is enforced by the request schemas and listed in the README."""
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway import bounds
from gateway.schemas import ChatCompletionRequest, CompletionRequest

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


@pytest.mark.parametrize("bound", bounds.BOUNDS, ids=lambda b: b.field)
def test_every_bound_has_its_readme_row(bound):
    assert bounds.readme_row(bound) in README


def _completion(**fields):
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def _chat(**fields):
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize("field, high", [
    ("max_tokens", bounds.MAX_TOKENS), ("min_tokens", bounds.MAX_TOKENS), ("top_k", bounds.TOP_K),
    ("n", bounds.N), ("seed", bounds.INT64_MAX), ("priority", bounds.PRIORITY),
    ("logprobs", bounds.LOGPROBS), ("prompt_logprobs", bounds.LOGPROBS)])
def test_numbers_are_bounded_at_both_ends(field, high):
    _completion(**{field: high})
    with pytest.raises(ValidationError):
        _completion(**{field: high + 1})
    with pytest.raises(ValidationError):
        _completion(**{field: 2**64 + 5})  # beyond 64 bits is just out of range


@pytest.mark.parametrize("fields", [
    {"stop": ["x" * (bounds.STOP_CHARS + 1)]}, {"stop": ["a"] * (bounds.STOP_SEQUENCES + 1)},
    {"stop": [""]}, {"stop_token_ids": [0] * (bounds.STOP_TOKEN_IDS + 1)},
    {"stop_token_ids": [-1]}, {"stop_token_ids": [bounds.TOKEN_ID_MAX + 1]},
    {"prompt": [1, -7]}, {"prompt": []}, {"prompt": [[1, 2], [3]]}, {"prompt": [[1, -7]]}, {"prompt": [[]]}, {"model": "m" * (bounds.MODEL_NAME_CHARS + 1)},
    {"user": "u" * (bounds.USER_CHARS + 1)}, {"echo": True, "prompt": [1, 2]},
    {"echo": True, "logprobs": 1, "stream": True, "n": 2}, {"prompt_logprobs_start": -1}])
def test_completion_fields_out_of_bounds_are_refused(fields):
    with pytest.raises(ValidationError):
        _completion(**fields)


@pytest.mark.parametrize("content", [
    [{"type": "text", "text": 5}], [{"type": "image_url", "image_url": {"url": "x"}}], [5], ["text"],
    [{"text": "no type"}]])
def test_content_parts_must_be_text_objects(content):
    with pytest.raises(ValidationError):
        _chat(messages=[{"role": "user", "content": content}])
    assert _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "ok"}]}]).messages[0].text() == "ok"


def test_message_count_is_bounded():
    with pytest.raises(ValidationError):
        _chat(messages=[{"role": "user", "content": "x"}] * (bounds.MESSAGES + 1))


def test_a_batch_of_one_prompt_is_that_prompt_and_of_several_is_refused_by_name():
    assert _completion(prompt=[[5, 6, 7]]).prompt == [5, 6, 7]  # as ["text"] is "text"
    assert _completion(prompt=["text"]).prompt == "text"
    for batch in ([[1], [2]], ["a", "b"]):
        with pytest.raises(ValidationError, match="batched prompts are not supported"):
            _completion(prompt=batch)
    with pytest.raises(ValidationError):  # the one list still bounded like any token-id prompt
        _completion(prompt=[[1] * (bounds.PROMPT_TOKEN_IDS + 1)])
