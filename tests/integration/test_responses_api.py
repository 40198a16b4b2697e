"""OpenAI's Responses API end to end: the official `openai` client, unmodified → a real gateway →
Redis → a real worker running the demo model (random weights: a grammar makes it write valid JSON
and forced tool calls, which is what these tests rely on). Usage per key is what the client was told."""
from __future__ import annotations

import json
import secrets
import signal

import httpx
import jsonschema
import openai
import pytest

from tests.integration.test_agents import SCORES, WEATHER
from tests.integration.test_faults import KEY, Cluster

ADMIN = "sk-kvg-responses-admin"
TOOL = {"type": "function", **WEATHER["function"]}  # Responses' tools are flat


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    c = Cluster(tmp_path_factory.mktemp("responses"), tiny_model_dir)
    c.start_gateway(KVGATE_ADMIN_KEY=ADMIN)
    c.start_worker("w-responses")
    yield c
    c.close()


def _key(cluster: Cluster, name: str | None = None, **fields) -> str:
    """A new key made through /admin (its secret)."""
    resp = httpx.post(cluster.url + "/admin/keys", headers={"Authorization": f"Bearer {ADMIN}"},
                      json={"name": name or "k-" + secrets.token_hex(4), **fields}, timeout=30)
    assert resp.status_code == 201, resp.text
    return resp.json()["secret"]


def _usage(cluster: Cluster, key_name: str) -> dict:
    resp = httpx.get(cluster.url + "/admin/usage", params={"key": key_name, "since": "1d"},
                     headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    return resp.json()["rows"][0]


def _client(cluster: Cluster, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_plain_and_streamed_give_the_same_text_and_usage_is_what_the_client_was_told(cluster):
    client = _client(cluster, _key(cluster, "responses-usage"))
    kwargs = dict(model="demo", input="Say something.", instructions="Be brief.", max_output_tokens=12,
                  temperature=0, store=False)
    whole = client.responses.create(**kwargs)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output[0].type == "message" and whole.output_text
    assert whole.output[0].status == "incomplete", "the limit cut the message"
    assert whole.usage.output_tokens == 12
    assert whole.usage.total_tokens == whole.usage.input_tokens + 12

    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == next(e.text for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert final.output_text == text and final.usage.total_tokens == whole.usage.total_tokens
    assert final.output[0].status == "incomplete"

    row = _usage(cluster, "responses-usage")
    assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == (
        2, whole.usage.input_tokens + final.usage.input_tokens, 24)


def test_a_json_schema_holds(cluster):
    out = _client(cluster).responses.create(
        model="demo", input="Scores?", max_output_tokens=200, temperature=1.0, extra_body={"seed": 4},
        text={"format": {"type": "json_schema", "name": "scores", "schema": SCORES, "strict": True}})
    assert out.status == "completed", out.output_text
    jsonschema.validate(json.loads(out.output_text), SCORES)


def test_a_function_call_and_its_output_sent_back_by_previous_response_id(cluster):
    client = _client(cluster)
    first = client.responses.create(model="demo", input="Weather in Oslo?", tools=[TOOL],
                                    tool_choice="required", parallel_tool_calls=False, extra_body={"seed": 1},
                                    max_output_tokens=200)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
    assert client.responses.retrieve(first.id).output[0].arguments == calls[0].arguments

    second = client.responses.create(
        model="demo", previous_response_id=first.id, tools=[TOOL], tool_choice="none", max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp": 21}'}])
    assert second.previous_response_id == first.id and second.output_text
    # the earlier turn (question, call) and the result are in the prompt
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens

    streamed = list(client.responses.create(model="demo", input="Weather?", tools=[TOOL], extra_body={"seed": 1},
                                            tool_choice={"type": "function", "name": "get_weather"},
                                            max_output_tokens=200, stream=True, store=False))
    types = [e.type for e in streamed]
    assert "response.function_call_arguments.delta" in types
    done = next(e for e in streamed if e.type == "response.function_call_arguments.done")
    pieces = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert pieces == done.arguments
    jsonschema.validate(json.loads(done.arguments), WEATHER["function"]["parameters"])
    assert streamed[-1].response.output[0].type == "function_call"


def test_stored_responses_belong_to_their_key(cluster):
    mine, theirs = _client(cluster), _client(cluster, _key(cluster))
    kept = mine.responses.create(model="demo", input="Hello", max_output_tokens=2)
    assert mine.responses.retrieve(kept.id).id == kept.id
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.create(model="demo", input="Hi", previous_response_id=kept.id, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.delete(kept.id)
    mine.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(kept.id)
    unkept = mine.responses.create(model="demo", input="Hello", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(unkept.id)


def test_refusals_are_clear(cluster):
    client = _client(cluster)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="demo", input="Hi", background=True)
    assert refused.value.body["param"] == "background"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="demo", input="Hi", tools=[{"type": "web_search"}])
    assert "only function tools" in refused.value.body["message"]
    with pytest.raises(openai.UnprocessableEntityError):
        client.responses.create(model="demo", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/x.png"}]}])


def test_the_size_quota_refuses_storing_past_it(tmp_path, tiny_model_dir):
    c = Cluster(tmp_path, tiny_model_dir)
    try:
        c.start_gateway(KVGATE_MAX_STORED_RESPONSE_BYTES_PER_KEY="1")
        c.start_worker("w-quota")
        client = _client(c)
        client.responses.create(model="demo", input="Hi", max_output_tokens=2)  # room: it was empty
        with pytest.raises(openai.RateLimitError) as refused:
            client.responses.create(model="demo", input="Hi", max_output_tokens=2)
        assert "KVGATE_MAX_STORED_RESPONSE_BYTES_PER_KEY" in refused.value.body["message"]
        assert client.responses.create(model="demo", input="Hi", max_output_tokens=2, store=False).output_text
    finally:
        c.close()


def test_a_stream_resumed_after_its_worker_dies_gives_the_same_text(tmp_path, tiny_model_dir):
    c = Cluster(tmp_path, tiny_model_dir)
    try:
        c.start_gateway()
        victim = c.start_worker("w-victim")
        client = _client(c)
        kwargs = dict(model="demo", input="Tell a long story.", max_output_tokens=150, temperature=0,
                      store=False)
        pieces = []
        for event in client.responses.create(stream=True, **kwargs):
            if event.type == "response.output_text.delta":
                pieces.append(event.delta)
                if len(pieces) == 10:  # mid-way: frozen, a survivor started, then killed
                    victim.send_signal(signal.SIGSTOP)
                    c.start_worker("w-survivor")
                    victim.send_signal(signal.SIGKILL)
            last = event
        assert c.fresh_info("w-survivor")["requests_resumed"] == 1
        assert last.type == "response.incomplete" and last.response.usage.output_tokens == 150
        assert "".join(pieces) == client.responses.create(**kwargs).output_text
    finally:
        c.close()
