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
    {"prompt": [1, -7]}, {"prompt": []}, {"prompt": [[1, 2], [3, -1]]}, {"prompt": [[1, -7]]}, {"prompt": [[]]}, {"model": "m" * (bounds.MODEL_NAME_CHARS + 1)},
    {"user": "u" * (bounds.USER_CHARS + 1)},
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


def test_a_batch_of_one_prompt_is_that_prompt_and_a_batchs_choices_are_bounded_as_n_is():
    assert _completion(prompt=[[5, 6, 7]]).prompt == [5, 6, 7]  # as ["text"] is "text"
    assert _completion(prompt=["text"]).prompt == "text"
    for batch in ([[1], [2]], ["a", "b"]):
        assert _completion(prompt=batch).prompt == batch and _completion(prompt=batch).num_prompts() == 2
    assert _completion(prompt=["a"] * bounds.N).num_prompts() == bounds.N
    with pytest.raises(ValidationError, match=r"9 prompts × n \(2\) = 18 choices; at most 16"):
        _completion(prompt=[[1]] * 9, n=2)
    with pytest.raises(ValidationError):
        _completion(prompt=["a"] * (bounds.N + 1))
    with pytest.raises(ValidationError, match="prompt 1 of the batch has no token ids"):
        _completion(prompt=[[1], []])
    with pytest.raises(ValidationError, match="token ids; at most"):  # all together, as one prompt's
        _completion(prompt=[[1] * (bounds.PROMPT_TOKEN_IDS // 2 + 1)] * 2)
    with pytest.raises(ValidationError):  # the one list still bounded like any token-id prompt
        _completion(prompt=[[1] * (bounds.PROMPT_TOKEN_IDS + 1)])
    for mixed in (["a", [1]], [[1], "a"], ["a", 5]):  # strings and ids are not mixed
        with pytest.raises(ValidationError, match="all strings or all lists of token ids"):
            _completion(prompt=mixed)
    for nested in ([["a"]], [[[1]]]):  # a batch of one list is one prompt of ids, and no deeper
        with pytest.raises(ValidationError, match="valid integer"):
            _completion(prompt=nested)


def _route_bodies():
    """Every route's body type, as the app serves it."""
    from fastapi.routing import APIRoute

    from gateway.app import create_app
    from shared.settings import GatewaySettings

    def routes(among):
        for route in among:
            if isinstance(route, APIRoute):
                yield route
            elif hasattr(route, "original_router"):  # an included router
                yield from routes(route.original_router.routes)
    app = create_app(GatewaySettings(secret="s" * 32))
    return {r.path: r.body_field.field_info.annotation for r in routes(app.routes) if r.body_field}


def _slow_to_refuse(node, parent=None, path="") -> list[str]:
    """Where in a pydantic core schema a body's list or mapping could be refused entry by entry:
    a list without fail_fast, or a mapping whose entries can fail that is not counted first
    (gateway/bounded.py `mapping`)."""
    found = []
    if isinstance(node, dict):
        kind = node.get("type")
        if kind in ("list", "set", "frozenset", "tuple") and not node.get("fail_fast"):
            found.append(f"{path}: a {kind} without fail_fast")
        free = ({"type": "any"}, {"type": "str"})
        if (kind == "dict" and (parent or {}).get("type") != "function-before"
                and not (node.get("keys_schema", free[0]) in free and node.get("values_schema", free[0]) in free)):
            found.append(f"{path}: a mapping counted after its entries")
        for key, value in node.items():
            found += _slow_to_refuse(value, node, f"{path}/{node.get('ref', key)}")
    elif isinstance(node, list):
        for value in node:
            found += _slow_to_refuse(value, parent, path)
    return found


def test_no_body_is_refused_entry_by_entry():
    """pydantic reports every bad entry of a list (and every one of a dict before its length), and
    FastAPI copies each report again: 300,000 negative token ids held the event loop for 3.3 s.
    Every list a route reads stops at its first bad entry, and every mapping is counted first."""
    from pydantic import TypeAdapter

    bodies = _route_bodies()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/tokenize",
            "/admin/keys", "/v1/batches"} <= set(bodies)
    for path, body in bodies.items():
        assert _slow_to_refuse(TypeAdapter(body).core_schema) == [], path


def test_the_walk_finds_a_list_that_reports_every_entry():
    from typing import Annotated

    from pydantic import BaseModel, Field, TypeAdapter

    class Loose(BaseModel):
        ids: list[int]
        named: dict[str, int]

    class Tight(BaseModel):
        ids: Annotated[list[int], Field(fail_fast=True)]
    assert len(_slow_to_refuse(TypeAdapter(Loose).core_schema)) == 2
    assert _slow_to_refuse(TypeAdapter(Tight).core_schema) == []


@pytest.mark.parametrize("model, body, where", [
    (CompletionRequest, {"prompt": [-1] * 300_000}, ("prompt", "list[constrained-int]", 0)),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text"}] * 40_000}]},
     ("messages", 0, "content", "list[TextPart]", 0, "text")),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                             "logit_bias": {str(-i): 1 for i in range(1, 60_000)}}, ("logit_bias",)),
    (CompletionRequest, {"prompt": "x", "stop": [1] * 100_000}, ("stop", "list[constrained-str]", 0)),
])
def test_a_huge_bad_list_is_refused_at_its_first_entry(model, body, where):
    with pytest.raises(ValidationError) as refused:
        model.model_validate({"model": "m", **body})
    errors = refused.value.errors()  # one a union branch at most (a prompt is one of four kinds)
    assert len(errors) <= 4 and where in [e["loc"] for e in errors]


def _call(arguments: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}


def _nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


@pytest.mark.parametrize("fields, says", [
    ({"repetition_penalty": 1e-46}, "greater than or equal to 0.01"),  # 0.0 in float32: NaN logits
    ({"chat_template_kwargs": {"k": _nested(300)}}, "nested at most 16 deep"),  # orjson: TypeError past 255
    ({"chat_template_kwargs": {"k": _nested(16)}}, "nested at most 16 deep"),
    ({"messages": [_call('{"a": "\\ud800"}')]}, "must be JSON text"),  # a lone surrogate the tokenizer can't take
    ({"messages": [_call("[" * 3000 + "]" * 3000)]}, "must be JSON text"),  # past Python's recursion limit
    ({"messages": [_call("[" * 65 + "]" * 65)]}, "nested at most 64 deep"),
    ({"messages": [_call('{"a": NaN}')]}, "must be JSON text"),
    ({"messages": [_call('{"a": 1e999}')]}, "must be JSON text"),
])
def test_what_the_worker_could_not_render_is_refused_naming_the_limit(fields, says):
    """Each of these reached the worker and failed there as a 500 its retry doubled (and which
    counted against the version's circuit breaker); now a 422 names the limit."""
    with pytest.raises(ValidationError, match=says):
        _chat(**fields)
    _chat(messages=[_call('{"a": [1, {"b": "é"}]}')], chat_template_kwargs={"k": _nested(15)}, repetition_penalty=0.01)


def test_calls_going_back_through_responses_and_messages_are_read_as_strictly():
    from gateway.messages_schemas import MessagesRequest
    from gateway.responses_schemas import ResponsesRequest

    with pytest.raises(ValidationError, match="must be JSON text"):
        ResponsesRequest.model_validate({"model": "m", "input": [
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 3000 + "]" * 3000}]})
    with pytest.raises(ValidationError, match="nested at most 64 deep"):
        MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": _nested(65)}]}]})
