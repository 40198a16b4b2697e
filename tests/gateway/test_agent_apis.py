"""Responses and Messages, gateway side: how each body becomes the one chat request, how a reply
stream becomes their items and events, and Anthropic's error shape and headers. Pure functions over
protocol messages; the end-to-end tests are tests/integration/test_responses_api.py and
test_messages_api.py."""
from __future__ import annotations

import asyncio

import orjson
import pytest

from gateway import anthropic_shape, tool_calls
from gateway.agent_schemas import NamedFunction, NamedToolChoice, Tool
from gateway.answer_io import chat_request
from gateway.answer_items import Append, Close, Items, Open
from gateway.messages_render import MessageRender
from gateway.messages_schemas import MessagesRequest
from gateway.responses_render import ResponseRender
from gateway.responses_schemas import ResponsesRequest
from shared import protocol
from shared.errors import InvalidRequest, Overloaded

WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def _delta(seq: int, text: str = "", reasoning: str | None = None, finish: str | None = None):
    return protocol.Delta(request_id="r", seq=seq, text=text, reasoning=reasoning, finish_reason=finish)


def _plain() -> Items:
    return Items(tool_calls.ChoiceOutput(tool_calls.reader(None, None, None)))


def _named() -> Items:
    tools = [Tool(type="function", function={"name": "get_weather"})]
    choice = NamedToolChoice(type="function", function=NamedFunction(name="get_weather"))
    return Items(tool_calls.ChoiceOutput(tool_calls.reader(tools, choice, None)))


# -- Responses → chat -------------------------------------------------------------------------
def test_a_responses_turn_becomes_chat_messages_after_the_stored_conversation():
    body = ResponsesRequest.model_validate({"model": "demo", "instructions": "Be brief.", "input": [
        {"role": "developer", "content": "Use metric units."},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{\"a\":1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "21"},
        {"type": "reasoning", "id": "rs_1", "summary": []}]})
    earlier = [{"role": "user", "content": "Weather?"}]
    conversation = body.conversation(earlier)
    assert conversation == [
        {"role": "user", "content": "Weather?"},
        {"role": "system", "content": "Use metric units."},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"a\":1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21"}]
    assert earlier == [{"role": "user", "content": "Weather?"}], "the stored conversation is not changed"
    chat = chat_request(body.chat(conversation))
    assert [m.role for m in chat.messages] == ["system", "user", "system", "assistant", "tool"]
    assert chat.messages[0].content == "Be brief."


def test_responses_tools_format_and_reasoning_translate():
    body = ResponsesRequest.model_validate({
        "model": "demo", "input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 7, "reasoning": {"effort": "none"}, "parallel_tool_calls": False})
    chat = chat_request(body.chat(body.conversation([])))
    assert chat.tools[0].function.name == "get_weather" and chat.tool_choice.function.name == "get_weather"
    assert chat.limit() == 7 and chat.parallel_tool_calls is False
    assert chat.template_kwargs() == {"enable_thinking": False, "reasoning_effort": "none"}
    fmt = ResponsesRequest.model_validate({"model": "demo", "input": "Hi", "reasoning": {"effort": "low"},
                                           "text": {"format": {"type": "json_schema", "name": "x",
                                                               "schema": {"type": "object"}}}})
    chat = chat_request(fmt.chat(fmt.conversation([])))
    assert chat.response_format.json_schema.schema_ == {"type": "object"}
    assert chat.template_kwargs() == {"enable_thinking": True, "reasoning_effort": "low"}


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format")])
def test_responses_refuse_what_they_cannot_serve_by_name(body, param):
    request = ResponsesRequest.model_validate({"model": "demo", "input": "Hi", **body})
    with pytest.raises(InvalidRequest) as refused:
        request.refuse_unserved()
        request.chat(request.conversation([]))
    assert refused.value.param == param


def test_a_conversation_past_chats_bounds_is_a_400_not_a_500():
    with pytest.raises(InvalidRequest) as refused:
        chat_request({"model": "demo", "messages": []})
    assert refused.value.param == "messages"


# -- Messages → chat --------------------------------------------------------------------------
def test_an_anthropic_conversation_becomes_chat_messages():
    body = MessagesRequest.model_validate({
        "model": "demo", "max_tokens": 9, "system": [{"type": "text", "text": "Be terse."}],
        "stop_sequences": ["END"], "top_k": 5,
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21"}]},
                {"type": "text", "text": "And tomorrow?"}]}]})
    chat = chat_request(body.chat())
    assert [m.entry() for m in chat.messages] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "content": "21", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And tomorrow?"}]
    assert chat.stop == ["END"] and chat.include_stop_str_in_output and chat.top_k == 5
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.chat_template_kwargs == {"enable_thinking": True} and chat.limit() == 9


def test_an_anthropic_server_tool_is_refused_by_name():
    body = MessagesRequest.model_validate({"model": "demo", "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"}], "tools": [{"type": "bash_20250124", "name": "bash"}]})
    with pytest.raises(InvalidRequest) as refused:
        body.chat()
    assert refused.value.param == "tools.0.type"


def test_an_anthropic_client_tool_without_its_input_schema_is_refused_by_name():
    body = MessagesRequest.model_validate({"model": "demo", "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"}], "tools": [{"name": "get_weather"}]})
    with pytest.raises(InvalidRequest) as refused:
        body.chat()
    assert refused.value.param == "tools.0.input_schema" and "required" in str(refused.value)


# -- replies → items ---------------------------------------------------------------------------
def test_reasoning_then_text_are_two_items_whole_or_in_pieces():
    whole = _plain()
    whole.feed(_delta(1, "Hello there", reasoning="Let me think.", finish="length"))
    pieces, events = _plain(), []
    for seq, (reasoning, text) in enumerate([("Let me ", ""), ("think.", "Hel"), (None, "lo there")], 1):
        events += pieces.feed(_delta(seq, text, reasoning, "length" if seq == 3 else None))
    assert [(i.kind, i.text) for i in pieces.items] == [(i.kind, i.text) for i in whole.items] == [
        ("reasoning", "Let me think."), ("text", "Hello there")]
    assert [type(e).__name__ for e in events] == ["Open", "Append", "Append", "Close", "Open",
                                                  "Append", "Append", "Close"]
    assert pieces.finish_reason == "length"


def test_whitespace_before_a_call_opens_no_text_item():
    items = _named()
    events = items.feed(_delta(1, "{\"city\": "))
    events += items.feed(_delta(2, "\"Oslo\"}", finish="stop"))
    assert [(i.kind, i.name, i.text) for i in items.items] == [("call", "get_weather", '{"city": "Oslo"}')]
    assert isinstance(events[0], Open) and isinstance(events[-1], Close)
    assert "".join(e.piece for e in events if isinstance(e, Append)) == '{"city": "Oslo"}'
    assert items.finish_reason == "tool_calls"
    plain = _plain()
    plain.feed(_delta(1, "  \n", finish="stop"))
    assert plain.items == [], "whitespace alone is no answer"


def test_the_stop_sequence_that_ended_it_is_cut_and_named():
    items = Items(_plain().output, stops=["xyz", "END"])
    items.feed(_delta(1, "one two "))
    items.feed(_delta(2, "threeEND", finish="stop"))
    assert items.items[0].text == "one two three" and items.stop_sequence == "END"


# -- renderers ---------------------------------------------------------------------------------
def _events(chunks: list[bytes]) -> list[dict]:
    return [orjson.loads(c.split(b"data: ", 1)[1]) for c in chunks]


def test_a_stop_sequence_in_the_thinking_ends_it_and_is_named_whole_or_streamed():
    whole = MessageRender("msg_1", "demo", Items(_plain().output, stops=["1"]))
    whole.delta(_delta(1, reasoning="226Form 1", finish="stop"))
    streamed = MessageRender("msg_2", "demo", Items(_plain().output, stops=["1"]))
    chunks = streamed.delta(_delta(1, reasoning="226")) + streamed.delta(_delta(2, reasoning="Form "))
    chunks += streamed.delta(_delta(3, reasoning="1", finish="stop"))
    chunks += asyncio.run(streamed.done({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}))
    events = _events(chunks)
    assert "".join(e["delta"]["thinking"] for e in events if e["type"] == "content_block_delta") == "226Form "
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "1"}
    for render in (whole, streamed):
        message = render.result()
        assert [(b["type"], b.get("thinking")) for b in message["content"]] == [("thinking", "226Form ")]
        assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "1")


def test_responses_events_are_typed_and_numbered_in_order():
    body = ResponsesRequest.model_validate({"model": "demo", "input": "Hi", "store": False})
    render = ResponseRender(body, "resp_1", _plain(), None)
    chunks = render.start() + render.delta(_delta(1, "Hi", reasoning="Hmm")) + render.delta(
        _delta(2, " you", finish="stop"))
    chunks += asyncio.run(render.done({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}))
    events = _events(chunks)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["usage"]["total_tokens"] == 5
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert final["output"][1]["content"][0]["text"] == "Hi you" == render.result()["output"][1]["content"][0]["text"]


def test_the_item_being_written_when_the_limit_or_an_error_ends_the_response_is_incomplete():
    body = ResponsesRequest.model_validate({"model": "demo", "input": "Hi", "store": False})
    cut = ResponseRender(body, "resp_1", _named(), None)
    chunks = cut.delta(_delta(1, "{\"city\": ")) + cut.delta(_delta(2, "\"Os", finish="length"))
    chunks += asyncio.run(cut.done({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}))
    events = _events(chunks)
    done = next(e for e in events if e["type"] == "response.output_item.done")
    assert done["item"]["type"] == "function_call" and done["item"]["status"] == "incomplete"
    assert events[-1]["type"] == "response.incomplete"
    assert [o["status"] for o in events[-1]["response"]["output"]] == ["incomplete"]
    assert [o["status"] for o in cut.result()["output"]] == ["incomplete"]

    failed = ResponseRender(body, "resp_2", _plain(), None)
    chunks = failed.delta(_delta(1, "Hi", reasoning="Hmm")) + failed.error(Overloaded("worker lost"))
    events = _events(chunks)
    assert [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"] == [
        "completed", "incomplete"]
    assert events[-1]["type"] == "response.failed"
    assert [(o["type"], o["status"]) for o in events[-1]["response"]["output"]] == [
        ("reasoning", "completed"), ("message", "incomplete")]


def test_messages_events_follow_anthropics_sequence_and_errors_its_shape():
    render = MessageRender("msg_1", "demo", _named())
    chunks = render.start() + render.delta(_delta(1, "{\"city\": \"Oslo\"}", finish="stop"))
    chunks += asyncio.run(render.done({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}))
    events = _events(chunks)
    assert [e["type"] for e in events] == ["message_start", "ping", "content_block_start",
                                           "content_block_delta", "content_block_stop", "message_delta",
                                           "message_stop"]
    assert events[2]["content_block"]["type"] == "tool_use" and events[2]["content_block"]["id"].startswith("toolu_")
    assert events[3]["delta"] == {"type": "input_json_delta", "partial_json": "{\"city\": \"Oslo\"}"}
    assert events[5]["delta"]["stop_reason"] == "tool_use" and events[5]["usage"] == {
        "input_tokens": 3, "output_tokens": 4}
    assert render.result()["content"][0]["input"] == {"city": "Oslo"}
    broken = MessageRender("msg_2", "demo", _plain())
    out = broken.delta(_delta(1, "Hi")) + broken.error(Overloaded("worker lost"))
    assert out[-1].startswith(b"event: error\n")
    assert _events(out)[-1] == {"type": "error", "error": {"type": "overloaded_error", "message": "worker lost"}}
    assert _events(out)[-2] == {"type": "content_block_stop", "index": 0}


# -- Anthropic's errors and headers ------------------------------------------------------------
@pytest.mark.parametrize("kvgate, status, kind", [(400, 400, "invalid_request_error"), (422, 400, "invalid_request_error"),
                                                  (401, 401, "authentication_error"), (404, 404, "not_found_error"),
                                                  (413, 413, "request_too_large"), (429, 429, "rate_limit_error"),
                                                  (500, 500, "api_error"), (503, 529, "overloaded_error")])
def test_kvgate_statuses_become_anthropics(kvgate, status, kind):
    assert anthropic_shape.status(kvgate) == status
    assert anthropic_shape.error_body(kvgate, "why") == {"type": "error", "error": {"type": kind, "message": "why"}}


def test_ratelimit_headers_in_anthropics_names():
    out = anthropic_shape.ratelimit_headers(
        {"x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59",
         "x-ratelimit-reset-requests": "1m5s", "x-ratelimit-limit-tokens": "1000",
         "x-ratelimit-remaining-tokens": "990", "x-ratelimit-reset-tokens": "250ms"}, now=0)
    assert out == {"anthropic-ratelimit-requests-limit": "60", "anthropic-ratelimit-requests-remaining": "59",
                   "anthropic-ratelimit-requests-reset": "1970-01-01T00:01:05Z",
                   "anthropic-ratelimit-tokens-limit": "1000", "anthropic-ratelimit-tokens-remaining": "990",
                   "anthropic-ratelimit-tokens-reset": "1970-01-01T00:00:00Z"}


def test_a_tool_use_input_that_cannot_travel_as_json_is_a_validation_error():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="64-bit"):
        MessagesRequest.model_validate({"model": "demo", "max_tokens": 1, "messages": [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                               "input": {"n": 2**70}}]}]})


def test_a_schema_with_an_integer_past_64_bits_is_a_validation_error():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="64-bit"):
        ResponsesRequest.model_validate({"model": "demo", "input": "x", "tools": [
            {"type": "function", "name": "f", "parameters": {"maximum": 2**70}}]})
