"""Anthropic's Messages API end to end: the official `anthropic` client, unmodified (it sends its key
as `x-api-key`) → a real gateway → Redis → a real worker running the demo model. Errors come back as
the client's own exceptions; usage per key is what the client was told."""
from __future__ import annotations

import json
import secrets
import signal

import anthropic
import httpx
import jsonschema
import pytest

from tests.integration.test_agents import SCORES, WEATHER
from tests.integration.test_faults import KEY, Cluster

ADMIN = "sk-kvg-messages-admin"
TOOL = {"name": "get_weather", "description": "Current weather of a city",
        "input_schema": WEATHER["function"]["parameters"]}
USER = [{"role": "user", "content": "Weather in Oslo?"}]
GREEDY = {"temperature": 0}  # still served; this client no longer sends sampling fields itself


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    c = Cluster(tmp_path_factory.mktemp("messages"), tiny_model_dir)
    c.start_gateway(KVGATE_ADMIN_KEY=ADMIN)
    c.start_worker("w-messages")
    yield c
    c.close()


def _key(cluster: Cluster, name: str, **fields) -> str:
    resp = httpx.post(cluster.url + "/admin/keys", headers={"Authorization": f"Bearer {ADMIN}"},
                      json={"name": name, **fields}, timeout=30)
    assert resp.status_code == 201, resp.text
    return resp.json()["secret"]


def _client(cluster: Cluster, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=cluster.url, api_key=key, max_retries=0, timeout=120)


def test_text_streamed_and_not_with_a_system_prompt_and_usage_as_told(cluster):
    name = "messages-" + secrets.token_hex(3)
    client = _client(cluster, _key(cluster, name))
    kwargs = dict(model="demo", max_tokens=12, extra_body=GREEDY, messages=[{"role": "user", "content": "Hi"}])
    plain = client.messages.create(**kwargs)
    with_system = client.messages.create(system="You are terse.", **kwargs)
    assert plain.type == "message" and plain.role == "assistant" and plain.id.startswith("msg_")
    assert plain.stop_reason == "max_tokens" and plain.usage.output_tokens == 12
    assert plain.content[0].type == "text" and plain.content[0].text
    assert with_system.usage.input_tokens > plain.usage.input_tokens  # the system prompt is rendered

    with client.messages.stream(system="You are terse.", **kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert {"content_block_start", "content_block_delta", "content_block_stop"} <= set(kinds)
    assert final.content[0].text == with_system.content[0].text
    assert final.usage.input_tokens == with_system.usage.input_tokens and final.usage.output_tokens == 12

    row = httpx.get(cluster.url + "/admin/usage", params={"key": name, "since": "1d"},
                    headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).json()["rows"][0]
    told = [plain.usage, with_system.usage, final.usage]
    assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == (
        3, sum(u.input_tokens for u in told), sum(u.output_tokens for u in told))


def test_stop_sequences_end_the_message_and_say_which(cluster):
    client = _client(cluster)
    kwargs = dict(model="demo", max_tokens=40, extra_body=GREEDY, messages=[{"role": "user", "content": "Go"}])
    text = client.messages.create(**kwargs).content[0].text
    stop = text.split()[3]  # a word in the middle of the greedy output
    cut = client.messages.create(stop_sequences=["never-written-xyz", stop], **kwargs)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]
    with client.messages.stream(stop_sequences=[stop], **kwargs) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "stop_sequence" and streamed.content[0].text == cut.content[0].text


def test_a_tool_use_round_trip(cluster):
    client = _client(cluster)
    first = client.messages.create(model="demo", max_tokens=200, messages=USER, tools=[TOOL],
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and len(uses) == 1
    assert uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, TOOL["input_schema"])

    with client.messages.stream(model="demo", max_tokens=200, messages=USER, tools=[TOOL],
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        deltas = [e.delta.partial_json for e in stream
                  if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        streamed = stream.get_final_message()
    use = next(b for b in streamed.content if b.type == "tool_use")
    assert deltas and json.loads("".join(deltas)) == use.input
    jsonschema.validate(use.input, TOOL["input_schema"])

    second = client.messages.create(model="demo", max_tokens=4, tools=[TOOL], messages=USER + [
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": '{"temp": 21}'}]}])
    assert second.content[0].type == "text"
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_an_output_schema_holds(cluster):
    out = _client(cluster).messages.create(model="demo", max_tokens=200, messages=USER,
                                           output_config={"format": {"type": "json_schema", "schema": SCORES}})
    assert out.stop_reason == "end_turn"
    jsonschema.validate(json.loads(out.content[0].text), SCORES)


def test_thinking_comes_back_as_thinking_blocks(cluster):
    client = _client(cluster)
    kwargs = dict(model="demo", max_tokens=8, extra_body=GREEDY, messages=[{"role": "user", "content": "Think"}],
                  thinking={"type": "enabled", "budget_tokens": 1024})
    whole = client.messages.create(**kwargs)
    assert whole.content[0].type == "thinking" and whole.content[0].thinking
    with client.messages.stream(**kwargs) as stream:
        thought = "".join(e.delta.thinking for e in stream
                          if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
    assert thought == whole.content[0].thinking


def test_a_stop_sequence_in_the_thinking_ends_the_thinking_and_says_which(cluster):
    client = _client(cluster)
    kwargs = dict(model="demo", max_tokens=30, extra_body=GREEDY, messages=[{"role": "user", "content": "Think"}],
                  thinking={"type": "enabled", "budget_tokens": 1024})
    thought = client.messages.create(**kwargs).content[0].thinking
    stop = thought.split()[3]  # a word in the middle of the greedy thinking
    cut = client.messages.create(stop_sequences=[stop], **kwargs)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert [b.type for b in cut.content] == ["thinking"] and cut.content[0].thinking == thought[:thought.index(stop)]
    with client.messages.stream(stop_sequences=[stop], **kwargs) as stream:
        pieces = "".join(e.delta.thinking for e in stream
                         if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
        streamed = stream.get_final_message()
    assert pieces == cut.content[0].thinking
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == stop


def test_errors_are_anthropics(cluster):
    limited = _client(cluster, _key(cluster, "messages-rpm-" + secrets.token_hex(3), rpm=1))
    limited.messages.create(model="demo", max_tokens=1, messages=USER)
    with pytest.raises(anthropic.RateLimitError) as refused:
        limited.messages.create(model="demo", max_tokens=1, messages=USER)
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "rate_limit_error"
    headers = refused.value.response.headers
    assert headers["anthropic-ratelimit-requests-limit"] == "1"
    assert headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert headers["anthropic-ratelimit-requests-reset"].endswith("Z")
    assert headers["x-ratelimit-limit-requests"] == "1"  # kvgate's own, too

    client = _client(cluster)
    with pytest.raises(anthropic.BadRequestError) as refused:  # max_tokens is required
        client.post("/v1/messages", cast_to=httpx.Response, body={"model": "demo", "messages": USER})
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in refused.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        _client(cluster, "sk-wrong").messages.create(model="demo", max_tokens=1, messages=USER)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=1, messages=USER)
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="demo", max_tokens=1, messages=USER,
                               tools=[{"type": "bash_20250124", "name": "bash"}])
    assert "client tools" in refused.value.body["error"]["message"]


def test_count_tokens_is_the_prompt_the_worker_counts(cluster):
    client = _client(cluster)
    counted = client.messages.count_tokens(model="demo", system="Be terse.", messages=USER, tools=[TOOL])
    served = client.messages.create(model="demo", max_tokens=1, system="Be terse.", messages=USER,
                                    tools=[TOOL], tool_choice={"type": "none"})
    assert counted.input_tokens == served.usage.input_tokens > 0


def test_a_stream_resumed_after_its_worker_dies_gives_the_same_text(tmp_path, tiny_model_dir):
    c = Cluster(tmp_path, tiny_model_dir)
    try:
        c.start_gateway()
        victim = c.start_worker("w-victim")
        client = _client(c)
        kwargs = dict(model="demo", max_tokens=150, extra_body=GREEDY,
                      messages=[{"role": "user", "content": "Tell a long story."}])
        pieces = []
        with client.messages.stream(**kwargs) as stream:
            for text in stream.text_stream:
                pieces.append(text)
                if len(pieces) == 10:  # mid-way: frozen, a survivor started, then killed
                    victim.send_signal(signal.SIGSTOP)
                    c.start_worker("w-survivor")
                    victim.send_signal(signal.SIGKILL)
            final = stream.get_final_message()
        assert c.fresh_info("w-survivor")["requests_resumed"] == 1
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 150
        assert "".join(pieces) == client.messages.create(**kwargs).content[0].text
    finally:
        c.close()
