"""Agents can use it (issue 17), end to end: the official `openai` client → a real gateway → Redis →
real workers running the engine on the tests' random-weight demo model. A grammar makes even random
weights write valid JSON, which is what these tests rely on: every constrained output is checked with
`jsonschema`, every tool call's arguments against its function's parameters.
"""
from __future__ import annotations

import asyncio
import json
import re
import signal
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.integration.test_faults import KEY, Cluster

SEEDS = range(50)
MAX_TOKENS = 200

PERSON = {  # nested object, enum, bounded integer, boolean, required fields
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "zip": {"type": "integer", "minimum": 10000,
                                                             "maximum": 99999}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "active"],
    "additionalProperties": False,
}
SCORES = {  # an array of numbers with bounded length, an enum
    "type": "object",
    "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50},
                              "minItems": 1, "maxItems": 5},
                   "grade": {"enum": ["A", "B", "C"]}},
    "required": ["scores", "grade"], "additionalProperties": False,
}
FLAGS = {  # array of objects
    "type": "object",
    "properties": {"flags": {"type": "array", "maxItems": 3,
                             "items": {"type": "object", "properties": {
                                 "on": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
                                 "required": ["on", "level"], "additionalProperties": False}}},
    "required": ["flags"], "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz_offset": {"type": "integer", "minimum": -12,
                                                                  "maximum": 14}},
                   "required": ["tz_offset"], "additionalProperties": False}}}


class Address(BaseModel):
    city: str = Field(max_length=10)
    zip: int = Field(ge=10000, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    address: Address


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    c = Cluster(tmp_path_factory.mktemp("agents"), tiny_model_dir)
    c.start_gateway()
    c.start_worker("w-agents")
    yield c
    c.close()


def _client(cluster: Cluster, cls=openai.OpenAI):
    return cls(base_url=cluster.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_parse_returns_a_validated_object(cluster):
    completion = _client(cluster).chat.completions.parse(
        model="demo", messages=_chat("Describe a person."), response_format=Person, seed=3,
        max_tokens=MAX_TOKENS)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person), message.content
    assert Person.model_validate_json(message.content) == message.parsed


@pytest.mark.parametrize("schema", [PERSON, SCORES, FLAGS], ids=["nested", "array", "objects"])
def test_fifty_seeds_give_valid_json(cluster, schema):
    client = _client(cluster, openai.AsyncOpenAI)

    async def one(seed: int):
        return await client.chat.completions.create(
            model="demo", messages=_chat(f"Answer {seed}"), seed=seed, temperature=1.0,
            max_tokens=MAX_TOKENS, response_format=_schema_format("answer", schema))

    async def all_seeds():
        return await asyncio.gather(*(one(seed) for seed in SEEDS))

    outputs = asyncio.run(all_seeds())
    for seed, out in zip(SEEDS, outputs):
        choice = out.choices[0]
        assert choice.finish_reason == "stop", f"seed {seed}: {choice.finish_reason}: {choice.message.content!r}"
        jsonschema.validate(json.loads(choice.message.content), schema)
    assert len({o.choices[0].message.content for o in outputs}) > 10, "the seeds should differ"


def test_regex_and_choice_hold(cluster):
    client = _client(cluster)
    for seed in range(5):
        out = client.completions.create(model="demo", prompt="Code:", seed=seed, max_tokens=40,
                                        extra_body={"structured_outputs": {"regex": r"[A-F]{3}-[0-9]{2,4}"}})
        text = out.choices[0].text
        assert out.choices[0].finish_reason == "stop"
        assert re.fullmatch(r"[A-F]{3}-[0-9]{2,4}", text), text
        out = client.chat.completions.create(model="demo", messages=_chat("Pick"), seed=seed, max_tokens=20,
                                             extra_body={"guided_choice": ["red", "green", "blue"]})
        assert out.choices[0].message.content in {"red", "green", "blue"}


def test_streaming_gives_the_same_text_as_not_streaming(cluster):
    client = _client(cluster)
    kwargs = dict(model="demo", messages=_chat("Scores?"), seed=11, max_tokens=MAX_TOKENS,
                  response_format=_schema_format("scores", SCORES))
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(stream=True, **kwargs) if chunk.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), SCORES)


def _check_calls(calls, tools: list[dict], names: set[str]) -> None:
    assert calls, "a tool call was required"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_validate_streamed_and_not(cluster, choice):
    client = _client(cluster)
    tools = [WEATHER, CLOCK]
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    names = {"get_weather", "get_time"} if choice == "required" else {"get_time"}
    # one call: with parallel calls allowed the grammar lets random weights go on calling to max_tokens
    kwargs = dict(tools=tools, tool_choice=tool_choice, parallel_tool_calls=False)
    for seed in range(5):
        out = client.chat.completions.create(model="demo", messages=_chat("What is the weather?"), seed=seed,
                                             max_tokens=MAX_TOKENS, **kwargs)
        assert out.choices[0].finish_reason in ("tool_calls", "stop")
        _check_calls(out.choices[0].message.tool_calls, tools, names)
        # streamed: name first, then the arguments in pieces, assembled by index
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(model="demo", messages=_chat("What is the weather?"),
                                                    seed=seed, max_tokens=MAX_TOKENS, stream=True, **kwargs):
            if not chunk.choices:
                continue
            finish = chunk.choices[0].finish_reason or finish
            for piece in chunk.choices[0].delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
                if piece.id:
                    assert call["id"] is None, "the id comes once"
                    call["id"] = piece.id
                if piece.function and piece.function.name:
                    assert call["arguments"] == "", "the name comes before the arguments"
                    call["name"] = piece.function.name
                if piece.function and piece.function.arguments:
                    call["arguments"] += piece.function.arguments
        assert finish in ("tool_calls", "stop")
        streamed = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
        whole = [(c.function.name, json.loads(c.function.arguments)) for c in out.choices[0].message.tool_calls]
        assert streamed == whole


def test_a_tool_result_renders_and_the_exchange_continues(cluster):
    client = _client(cluster)
    messages = _chat("Weather in Paris?")
    asked = client.chat.completions.create(model="demo", messages=messages, seed=1, max_tokens=MAX_TOKENS,
                                           tools=[WEATHER], tool_choice="required")
    first = asked.choices[0].message
    assert first.tool_calls
    messages += [first.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": '{"temp": 21}'}]
    second = client.chat.completions.create(model="demo", messages=messages, seed=1, max_tokens=8,
                                            tools=[WEATHER], tool_choice="none")
    assert second.choices[0].message.content
    # the call and its result are in the prompt: it grew by more than the call's own tokens
    assert second.usage.prompt_tokens > asked.usage.prompt_tokens + asked.usage.completion_tokens


def test_unsupported_fields_are_refused_by_name(cluster):
    client = _client(cluster)
    for extra, param in [({"prediction": {"type": "content", "content": "x"}}, "prediction"),
                         ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
                         ({"response_format": {"type": "json_schema", "json_schema": {
                             "name": "x", "schema": {"type": "nonsense"}}}}, "response_format")]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="demo", messages=_chat("hi"), max_tokens=4, extra_body=extra)
        assert refused.value.body["param"] == param or param in refused.value.body["message"], refused.value.body


def test_a_grammar_too_dear_to_match_fails_alone_with_a_400(cluster, tiny_model_dir):
    """An ambiguous grammar compiles at once, and its matching then grows with the output on the
    worker's step loop: at the default structured_max_token_ms its request ends with a 400 naming
    the bound (a few hundred tokens in, seconds later, not after minutes of stalling the batch),
    and a request sent beside it is served whole."""
    from worker.engine.tokenizer import load_tokenizer

    a = load_tokenizer(tiny_model_dir).convert_tokens_to_ids("a")
    client, async_client = _client(cluster), _client(cluster, openai.AsyncOpenAI)

    async def beside():
        return await async_client.chat.completions.create(
            model="demo", messages=_chat("hi"), max_tokens=64, extra_body={"ignore_eos": True})

    async def both():
        other = asyncio.ensure_future(beside())
        with pytest.raises(openai.BadRequestError) as refused:
            await asyncio.to_thread(
                client.chat.completions.create, model="demo", messages=_chat("a"), max_tokens=1800,
                logit_bias={str(a): 100}, extra_body={"structured_outputs": {"grammar": 'root ::= s "."\ns ::= s s | "a"'}})
        return refused.value.body, await other

    body, other = asyncio.run(both())
    assert body["code"] == "invalid_structured_output" and body["param"] == "structured_outputs", body
    assert "structured_max_token_ms" in body["message"]
    assert other.usage.completion_tokens == 64 and other.choices[0].finish_reason == "length"


def test_a_constrained_stream_resumed_after_its_worker_dies_is_whole_and_valid(tmp_path, tiny_model_dir):
    """The worker running a constrained stream is killed mid-way; the survivor rebuilds the matcher
    from the tokens already sent and the client gets the same JSON as an uninterrupted run (seeded)."""
    c = Cluster(tmp_path, tiny_model_dir)
    try:
        c.start_gateway()
        victim = c.start_worker("w-victim")
        schema = {"type": "object", "properties": {"xs": {"type": "array", "minItems": 40, "maxItems": 40,
                                                          "items": {"type": "integer", "minimum": 0,
                                                                    "maximum": 999}}},
                  "required": ["xs"], "additionalProperties": False}
        kwargs = dict(model="demo", messages=_chat("Numbers"), seed=5, max_tokens=400,
                      response_format=_schema_format("xs", schema))
        client = _client(c)
        pieces = []
        stream = client.chat.completions.create(stream=True, **kwargs)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if len(pieces) == 10:  # mid-way: frozen first, so it cannot finish while the survivor starts
                victim.send_signal(signal.SIGSTOP)
                c.start_worker("w-survivor")
                victim.send_signal(signal.SIGKILL)
        resumed = "".join(pieces)
        assert c.fresh_info("w-survivor")["requests_resumed"] == 1
        jsonschema.validate(json.loads(resumed), schema)
        whole = client.chat.completions.create(**kwargs).choices[0].message.content
        assert resumed == whole
    finally:
        c.close()


def test_thinking_goes_to_reasoning_content_and_the_grammar_holds_the_answer(cluster, tiny_model_dir):
    """The demo template opens <think> when asked to think; the constraint waits for </think> (pushed
    by logit_bias, as random weights rarely write it) and holds the answer; streamed = whole."""
    from worker.engine.tokenizer import load_tokenizer

    end = load_tokenizer(tiny_model_dir).convert_tokens_to_ids("</think>")
    kwargs = dict(model="demo", messages=_chat("Think, then score."), seed=2, max_tokens=MAX_TOKENS,
                  response_format=_schema_format("scores", SCORES),
                  extra_body={"chat_template_kwargs": {"enable_thinking": True}, "logit_bias": {str(end): 5}})
    client = _client(cluster)
    message = client.chat.completions.create(**kwargs).choices[0].message
    thought = message.model_extra.get("reasoning_content")
    assert thought and "think>" not in thought
    jsonschema.validate(json.loads(message.content), SCORES)
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            delta = chunk.choices[0].delta
            streamed["reasoning_content"] += delta.model_extra.get("reasoning_content") or ""
            streamed["content"] += delta.content or ""
    assert streamed == {"reasoning_content": thought, "content": message.content}
    plain = client.chat.completions.create(**{**kwargs, "extra_body": {"logit_bias": {str(end): 5}}})
    assert plain.choices[0].message.model_extra.get("reasoning_content") is None, "not asked to think"
