"""Structured outputs, tools and reasoning through the real gateway process: what the queued entry
carries, and the response shapes the official `openai` client reads back (tool_calls,
reasoning_content, finish_reason), streamed and not. The worker is played at the protocol level
(test_schema_skew.ProtocolPeer): it registers a tool-call parser and a vocabulary, records each raw
entry and answers with the text a model of that family would write; no engine runs. The engine's
side (masking, the chat template) is tested with the engine."""
from __future__ import annotations

import json
import time

import httpx
import openai
import orjson
import pytest

from shared import names, protocol
from tests.integration.test_faults import HEADERS, Cluster, _wait
from tests.integration.test_schema_skew import MODEL, ProtocolPeer

VOCAB = 1000
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}}
USER = [{"role": "user", "content": "Weather in Oslo?"}]


class AgentPeer(ProtocolPeer):
    """A worker of this release for a Hermes-style model: it answers each entry with the pieces the
    test queued (text, or (reasoning, text)), then the finish reason."""

    def __init__(self, redis_url: str):
        self.pieces: list = ["ok"]
        self.finish = "stop"
        self.parser: str | None = "hermes"
        super().__init__(redis_url, speaks=protocol.SCHEMA_VERSION, advertise=True)

    def _info(self) -> dict:
        return {**super()._info(), "vocab_size": VOCAB, "tool_call_parser": self.parser,
                "schema": self.speaks}

    def _answer(self, entry: dict) -> None:
        rid, channel, replies = entry["request_id"], entry["reply_channel"], []
        for seq, piece in enumerate(self.pieces, start=1):
            reasoning, text = piece if isinstance(piece, tuple) else (None, piece)
            reply = {"v": self.speaks, "type": "delta", "request_id": rid, "seq": seq, "index": 0,
                     "text": text, "token_ids": [5]}
            if reasoning:
                reply["reasoning"] = reasoning
            replies.append(reply)
        replies[-1]["finish_reason"] = self.finish
        replies.append({"v": self.speaks, "type": "done", "request_id": rid, "seq": len(replies) + 1,
                        "prompt_tokens": 3, "completion_tokens": len(self.pieces)})
        raws = [orjson.dumps(r) for r in replies]
        self.client.rpush(names.checkpoint_key(rid), *raws)
        self.client.expire(names.checkpoint_key(rid), 60)
        self.client.publish(channel, b"[" + b",".join(raws) + b"]")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    c = Cluster(tmp_path_factory.mktemp("agents"), tiny_model_dir)
    c.start_gateway()
    c.peer = AgentPeer(c.redis.url)
    c.peer.start()
    _wait(lambda: MODEL in [m["id"] for m in httpx.get(c.url + "/v1/models", headers=HEADERS,
                                                      timeout=2).json()["data"]], c.procs[0])
    yield c
    c.peer.stopping.set()
    c.peer.join(5)
    c.close()


@pytest.fixture
def peer(cluster):
    p = cluster.peer
    p.pieces, p.finish, p.parser, p.speaks = ["ok"], "stop", "hermes", protocol.SCHEMA_VERSION
    time.sleep(0.6)  # past the gateway's registry cache, should the last test have changed it
    return p


@pytest.fixture
def client(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key=HEADERS["Authorization"].split()[1],
                         max_retries=0)


def _post(cluster, body: dict) -> httpx.Response:
    return httpx.post(cluster.url + "/v1/chat/completions", headers=HEADERS, timeout=30,
                      json={"model": MODEL, "messages": USER, **body})


def test_the_entry_carries_tools_template_kwargs_tool_messages_and_the_constraint(cluster, peer, client):
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "call_9", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_9", "content": "-3 C"}]
    client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    entry = peer.entries[-1]
    assert entry["v"] == protocol.SCHEMA_VERSION
    assert entry["tools"] == [WEATHER] and entry["chat_template_kwargs"] == {"enable_thinking": False}
    assert entry["messages"][1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert entry["messages"][2] == {"role": "tool", "content": "-3 C", "tool_call_id": "call_9"}
    assert json.loads(entry["params"]["structured_outputs"]["json"]) == WEATHER["function"]["parameters"]
    client.chat.completions.create(model=MODEL, messages=USER, response_format={
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}, "strict": True}})
    assert peer.entries[-1]["params"]["structured_outputs"]["json"] == '{"type":"integer"}'
    client.chat.completions.create(model=MODEL, messages=USER, reasoning_effort="none")
    assert peer.entries[-1]["chat_template_kwargs"] == {"enable_thinking": False, "reasoning_effort": "none"}


def test_auto_parses_the_families_calls_whole_and_streamed(cluster, peer, client):
    peer.pieces = [("The user wants weather. ", ""), ("Call it.", ""), "<tool_call>\n{\"name\": \"get_",
                   "weather\", \"arguments\": {\"city\":", " \"Oslo\"}}\n</tool", "_call>"]
    whole = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER])
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    assert choice.message.reasoning_content == "The user wants weather. Call it."

    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert all(tc.id is None and tc.function.name is None for tc in calls[1:])
    assert len(calls) == 2, "the arguments came in pieces, as the model wrote them"
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "Oslo"}
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "The user wants weather. Call it."
    assert not any(d.content for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == len(peer.pieces)


def test_text_that_is_not_a_call_stays_content(cluster, peer, client):
    peer.pieces = ["It is cold ", "<tool", "box> in Oslo."]
    whole = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER])
    assert whole.choices[0].message.content == "It is cold <toolbox> in Oslo."
    assert whole.choices[0].message.tool_calls is None and whole.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "It is cold <toolbox> in Oslo."


def test_a_forced_call_is_parsed_by_the_gateway_streamed_and_not(cluster, peer, client):
    peer.parser = None  # no family parser: required and named need none
    time.sleep(0.6)
    peer.pieces = ['[{"name": "get_weather", ', '"parameters": {"city": "Ber', 'gen"}}]']
    for stream in (False, True):
        resp = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER],
                                              tool_choice="required", stream=stream)
        if stream:
            calls = [tc for c in resp if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            name, args = calls[0].function.name, "".join(tc.function.arguments or "" for tc in calls)
        else:
            assert resp.choices[0].finish_reason == "tool_calls"
            name, args = resp.choices[0].message.tool_calls[0].function.name, resp.choices[0].message.tool_calls[0].function.arguments
        assert name == "get_weather" and json.loads(args) == {"city": "Bergen"}
    peer.pieces, peer.finish = ['{"city": ', '"Tromsø"'], "length"  # cut by max_tokens: it says so
    named = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}})
    assert named.choices[0].finish_reason == "length"
    assert named.choices[0].message.tool_calls[0].function.arguments == '{"city": "Tromsø"'
    err = _post(cluster, {"tools": [WEATHER]}).json()["error"]  # auto, and no parser registered
    assert err["param"] == "tool_choice" and "parser" in err["message"]


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "not a valid JSON schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "does not compile"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a", "b"]}, "guided_choice",
     "response_format and guided_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "missing"}}},
     "tool_choice", "'missing'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
      "required": "city"}}}]}, "tools.0.function.parameters", "not a valid JSON schema"),
    ({"functions": [{"name": "f"}]}, "functions", "legacy"),
    ({"modalities": ["audio"]}, "modalities", "text"),
    ({"logit_bias": {str(VOCAB): 5}}, "logit_bias", "vocabulary"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
])
def test_what_cannot_be_served_is_a_400_naming_it_before_anything_is_queued(cluster, peer, body, param, words):
    seen = len(peer.entries)
    resp = _post(cluster, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error"
    time.sleep(0.3)
    assert len(peer.entries) == seen, "a refused request was queued"


def test_a_worker_of_the_previous_schema_gets_no_feature_it_would_drop(cluster, peer, client):
    peer.speaks = 2
    time.sleep(0.6)
    plain = client.chat.completions.create(model=MODEL, messages=USER)
    assert plain.choices[0].message.content == "ok" and peer.entries[-1]["v"] == 2
    for body, param in (({"tools": [WEATHER], "tool_choice": "none"}, "tools"),
                        ({"guided_choice": ["a"]}, "structured_outputs"),
                        ({"logit_bias": {"5": 1}}, "logit_bias"),
                        ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs")):
        resp = _post(cluster, body)
        assert resp.status_code == 503 and resp.headers["retry-after"], resp.text
        err = resp.json()["error"]
        assert err["code"] == "upgrade_in_progress" and err["param"] == param


def test_the_openai_clients_parse_sends_a_schema_and_reads_the_object_back(cluster, peer, client):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        population: int

    peer.pieces = ['{"name": "Oslo", ', '"population": 717710}']
    parsed = client.chat.completions.parse(model=MODEL, messages=USER, response_format=City)
    assert parsed.choices[0].message.parsed == City(name="Oslo", population=717710)
    schema = json.loads(peer.entries[-1]["params"]["structured_outputs"]["json"])
    assert schema["required"] == ["name", "population"] and schema["additionalProperties"] is False
