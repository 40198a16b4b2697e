"""The agents' request fields, as the gateway reads them before anything is queued: one constraint
from every spelling, tool_choice turned into a constraint, checks that name the problem (400), the
one list of refused fields, and the shapes of calls going back out."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import jsonschema
import pytest
from pydantic import ValidationError

from gateway import structured, tool_calls
from gateway.checker import Checker
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.unsupported import check_supported
from shared import tool_parsers as tp
from shared.errors import InvalidRequest

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def _refusal(fn, *args) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        fn(*args)
    return info.value


@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}},
     {"json": '{"type":"integer"}'}),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"json": {"type": "string"}}}, {"json": '{"type":"string"}'}),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
    ({"guided_json": '{"type": "boolean"}'}, {"json": '{"type": "boolean"}'}),
    ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
    ({"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
])
def test_every_spelling_becomes_the_one_constraint(fields, expected):
    got = _chat(**fields).to_sampling_params().structured_outputs
    assert (got and {k: v for k, v in vars(got).items() if v not in (None, False)}) == expected
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields}
                                            ).to_sampling_params().structured_outputs == got


def test_two_constraints_at_once_are_refused_naming_both():
    err = _refusal(_chat(response_format={"type": "json_object"}, guided_regex="a+").constraint)
    assert "response_format and guided_regex" in err.message and err.param == "guided_regex"
    err = _refusal(_chat(tools=[WEATHER], tool_choice="required", guided_choice=["a"]).constraint)
    assert "tool_choice" in err.message and err.param == "guided_choice"
    err = _refusal(_chat(structured_outputs={"regex": "a", "grammar": 'root ::= "a"'}).constraint)
    assert "regex, grammar" in err.message and err.param == "structured_outputs"
    err = _refusal(_chat(response_format={"type": "xml"}).constraint)
    assert err.param == "response_format.type" and "'xml'" in err.message


def test_a_named_tool_choice_constrains_to_its_parameters_and_must_name_a_tool():
    body = _chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = body.constraint()
    assert c.param == "tool_choice" and json.loads(c.outputs.json) == WEATHER["function"]["parameters"]
    missing = _chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    err = _refusal(missing.constraint)
    assert err.param == "tool_choice" and "'nope'" in err.message
    assert _refusal(_chat(tool_choice="required").constraint).param == "tool_choice"


@pytest.mark.parametrize("parallel", [True, False])
def test_required_asks_for_an_array_of_calls_to_any_tool(parallel):
    schema = json.loads(_chat(tools=[WEATHER, TIME], tool_choice="required",
                              parallel_tool_calls=parallel).constraint().outputs.json)
    two = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(two[:1], schema)
    for wrong in ([], [{"name": "other", "parameters": {}}], [{"name": "get_weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    if parallel:
        jsonschema.validate(two, schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(two, schema)


def test_the_output_of_a_forced_required_call_streams_as_calls():
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    for size in (1, 5, len(text)):
        out = tool_calls.ChoiceOutput(tool_calls.reader(_chat(tools=[WEATHER]).tools, "required", None))
        deltas = [out.delta(text[i:i + size], i + size >= len(text)) for i in range(0, len(text), size)]
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        starts = [c for c in calls if "id" in c]
        assert [c["function"]["name"] for c in starts] == ["get_weather", "get_time"]
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in starts)
        args = {i: "".join(c["function"]["arguments"] for c in calls if c["index"] == i) for i in (0, 1)}
        assert json.loads(args[0]) == {"city": "Oslo"} and json.loads(args[1]) == {}
        assert not any("content" in d for d in deltas)
        assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"


def test_a_whole_message_with_calls_has_null_content():
    out = tool_calls.ChoiceOutput(tp.make("hermes"))
    msg = out.message('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert msg["content"] is None and msg["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    plain = tool_calls.ChoiceOutput(tool_calls.reader(None, None, None))
    assert plain.message("hi") == {"role": "assistant", "content": "hi"} and plain.finish_reason("stop") == "stop"


@pytest.fixture(scope="module")
def check():
    """The gateway's checker (its own process, started once here), asked about a body's checks: the
    400 it answers, or None."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    checker = Checker(10, 1, 1024)

    def run(fields: dict) -> InvalidRequest | None:
        body = _chat(**fields)
        try:
            asyncio.run_coroutine_threadsafe(
                checker.check(structured.checks(body.constraint(), body.tools), "key"), loop).result(60)
        except InvalidRequest as exc:
            return exc
        return None
    yield run
    asyncio.run_coroutine_threadsafe(checker.stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join()


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format", "not a valid JSON schema"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ({"structured_outputs": {"json": {"type": "object", "minProperties": -1}}}, "structured_outputs",
     "minProperties"),
    ({"guided_regex": "[a-"}, "guided_regex", "does not compile"),
    # xgrammar's assertion ("Check failed: (val >= MIN_INT64_AS_DOUBLE) is false") said as the limit
    ({"guided_json": {"type": "integer", "minimum": -1e300}}, "guided_json",
     "does not compile: Integer exceeds minimum limit (an integer's bounds must lie within 64 bits"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
      "properties": {"a": {"type": "nonsense"}}}}}], "tool_choice": "required"},
     "tools.0.function.parameters", "valid JSON"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
      "tool_choice": "none"}, "tools.0.function.parameters", "valid JSON"),
])
def test_a_constraint_that_is_invalid_or_does_not_compile_is_a_400_naming_it(check, fields, param, words):
    err = check(fields)
    assert err is not None and err.status == 400 and err.param == param and words in err.message, err


def test_valid_constraints_pass_the_check(check):
    for fields in ({"response_format": {"type": "json_object"}}, {"guided_regex": "[a-z]{3}"},
                   {"guided_grammar": 'root ::= "yes" | "no"'}, {"guided_choice": ["a"]},
                   {"tools": [WEATHER], "tool_choice": "required"}):
        assert check(fields) is None, fields


def test_tools_kvgate_cannot_serve_are_400s():
    bad_type = _chat(tools=[{"type": "custom", "function": {"name": "f"}}])
    assert _refusal(tool_calls.check, bad_type.tools, "auto", "hermes").param == "tools.0.type"
    twice = _chat(tools=[WEATHER, WEATHER])
    assert _refusal(tool_calls.check, twice.tools, "auto", "hermes").param == "tools.1.function.name"
    err = _refusal(tool_calls.check, _chat(tools=[WEATHER]).tools, "auto", None)
    assert err.param == "tool_choice" and "parser" in err.message
    tool_calls.check(_chat(tools=[WEATHER]).tools, "required", None)  # forced: no parser needed


@pytest.mark.parametrize("fields, param", [
    ({"functions": [{"name": "f"}]}, "functions"), ({"function_call": "auto"}, "function_call"),
    ({"audio": {"voice": "x"}}, "audio"), ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"web_search_options": {}}, "web_search_options"), ({"best_of": 3}, "best_of"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_fields_that_would_be_ignored_are_refused_by_name(fields, param):
    err = _refusal(check_supported, _chat(**fields))
    assert err.status == 400 and err.param == param and param in err.message


def test_reasoning_effort_is_the_templates_thinking_switch_under_the_clients_own_kwargs():
    assert _chat().template_kwargs() is None
    assert _chat(reasoning_effort="none").template_kwargs() == {"enable_thinking": False, "reasoning_effort": "none"}
    assert _chat(reasoning_effort="high").template_kwargs() == {"enable_thinking": True, "reasoning_effort": "high"}
    own = _chat(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True, "x": 1}).template_kwargs()
    assert own == {"enable_thinking": True, "reasoning_effort": "none", "x": 1}
    err = _refusal(check_supported, CompletionRequest(model="demo", prompt="hi", reasoning_effort="low"))
    assert err.param == "reasoning_effort" and "chat/completions" in err.message


def test_labels_and_implemented_values_stay_accepted():
    check_supported(_chat(user="u", metadata={"a": "b"}, store=False, service_tier="auto",
                          safety_identifier="s", modalities=["text"], best_of=1, logprobs=True,
                          top_logprobs=2, tools=[WEATHER], chat_template_kwargs={"enable_thinking": False}))
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x", "tools": [WEATHER]})
    assert _refusal(check_supported, completion).param == "tools"
    suffix = CompletionRequest.model_validate({"model": "m", "prompt": "x", "suffix": "end"})
    assert _refusal(check_supported, suffix).param == "suffix"


def test_template_kwargs_are_bounded_and_may_not_replace_the_templates_own_arguments():
    for kwargs in ({"add_generation_prompt": False}, {"messages": []}, {"tools": []}, {"tokenize": True},
                   {"x": "y" * 5000}, {f"k{i}": i for i in range(40)}):
        with pytest.raises(ValidationError):
            _chat(chat_template_kwargs=kwargs)


def test_tool_messages_round_trip_onto_the_entry():
    body = _chat(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}])
    assert [m.entry() for m in body.messages][1:] == [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "-3 C", "tool_call_id": "call_1"}]
    with pytest.raises(ValidationError):
        _chat(messages=[{"role": "tool", "content": "no id"}])
    with pytest.raises(ValidationError):
        _chat(messages=[{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}])


def test_parallel_tool_calls_false_keeps_the_first_call_of_an_auto_output():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    one = tool_calls.ChoiceOutput(tp.make("hermes"), parallel=False).message(text)
    both = tool_calls.ChoiceOutput(tp.make("hermes")).message(text)
    assert [c["function"]["name"] for c in one["tool_calls"]] == ["a"]
    assert [c["function"]["name"] for c in both["tool_calls"]] == ["a", "b"]


def test_a_schema_nested_too_deep_is_refused_before_it_is_compiled(check):
    from gateway import bounds
    from shared.sampling import json_depth

    deep = {"type": "integer"}
    for _ in range(bounds.SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    started = time.monotonic()
    err = check({"guided_json": deep})
    assert err.param == "guided_json" and "deeper than" in err.message
    assert time.monotonic() - started < 5
    assert json_depth({"a": [1, {"b": {}}]}) == 4 and json_depth(5) == 0


@pytest.mark.parametrize("field, value, hint", [
    ("stop", ["x"], None), ("logit_bias", {"5": 10}, None), ("n", 2, None), ("presence_penalty", 1.0, None),
    ("structured_outputs", {"regex": "a+"}, None), ("chat_template_kwargs", {"enable_thinking": True}, None),
    ("response_format", {"type": "json_object"}, "text.format"), ("max_tokens", 5, "max_output_tokens"),
    ("min_tokens", 3, None), ("stop_token_ids", [7], None),
])
def test_chat_fields_sent_to_responses_are_refused_by_name_not_dropped(field, value, hint):
    """They changed the output on chat and were silently dropped here (200, unconstrained text)."""
    from gateway.responses_schemas import ResponsesRequest

    body = ResponsesRequest.model_validate({"model": "m", "input": "hi", field: value})
    err = _refusal(body.refuse_unserved)
    assert err.param == field and err.code == "unsupported_parameter" and field in err.message
    assert hint is None or hint in err.message
    ResponsesRequest.model_validate({"model": "m", "input": "hi", "n": 1, "logprobs": False, "stop": [],
                                     "metadata": {"a": "b"}}).refuse_unserved()  # chat's defaults change nothing


@pytest.mark.parametrize("field, value, hint", [
    ("stop", ["x"], "stop_sequences"), ("response_format", {"type": "json_object"}, "output_config.format"),
    ("logit_bias", {"5": 10}, None), ("n", 3, None), ("guided_regex", "a+", None),
    ("chat_template_kwargs", {"enable_thinking": False}, "thinking"), ("mcp_servers", [{"url": "x"}], None),
    ("container", "c1", None),
])
def test_chat_fields_and_server_tools_sent_to_messages_are_refused_by_name(field, value, hint):
    from gateway.messages_schemas import MessagesRequest

    body = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, field: value,
                                           "messages": [{"role": "user", "content": "hi"}]})
    err = _refusal(body.refuse_unserved)
    assert err.param == field and err.code == "unsupported_parameter"
    assert hint is None or hint in err.message
    MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                                    "metadata": {"user_id": "u"}, "service_tier": "auto"}).refuse_unserved()


@pytest.mark.parametrize("schema, where, word", [
    ({"type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "minItems": 3}, "#", "uniqueItems"),
    ({"type": "object", "properties": {"v": {"type": "integer", "not": {"const": 3}}}}, "#/properties/v", "not"),
    ({"anyOf": [{"type": "integer"}, {"type": "array", "contains": {"const": 1}}]}, "#/anyOf/1", "contains"),
    ({"$defs": {"x": {"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}}}, "$ref": "#/$defs/x"},
     "#/$defs/x", "if"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}}, "#", "dependentRequired"),
])
def test_a_json_schema_keyword_the_grammar_cannot_enforce_is_refused_by_name(schema, where, word):
    """uniqueItems on booleans gave [false, true, true], which the client was told matched."""
    code, message = structured.problem("json", json.dumps(schema))
    assert code == "invalid_schema" and f"uses {word} at {where}, which the grammar cannot enforce" in message


def test_keyword_names_used_as_property_names_or_enum_values_are_not_refused():
    schema = {"type": "object", "properties": {"not": {"type": "string"}, "contains": {"enum": ["if", "then"]}},
              "required": ["not"], "$defs": {"uniqueItems": {"type": "integer"}}}
    assert structured.problem("json", json.dumps(schema)) is None
    tool_parameters = json.dumps({"type": "array", "uniqueItems": True})  # a tool's: not a constraint
    assert structured.problem("schema", tool_parameters) is None
