"""The whole path with real parts: openai client → gateway → Redis stream → worker → pub/sub → SSE."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.conftest import start_stack, stop_stack  # plain helpers (python -m pytest puts . on the path)


@pytest.fixture
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.key, max_retries=0, timeout=120)


def _timed_stream(stream):
    pieces = []
    for chunk in stream:
        for choice in chunk.choices:
            text = getattr(choice, "delta", None)
            text = text.content if text is not None else choice.text
            if text:
                pieces.append((time.perf_counter(), text))
    return pieces


def test_chat_stream_arrives_token_by_token(client):
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Hello there"}], stream=True,
        max_tokens=48, extra_body={"ignore_eos": True})
    pieces = _timed_stream(stream)
    assert len(pieces) >= 10, "a 48-token stream should arrive in many chunks"
    first, last = pieces[0][0] - start, pieces[-1][0] - start
    # buffered, the 48 pieces would come in one burst at the end (a read or two, well under a
    # millisecond apart); streamed, they spread over the 47 decode steps after the first token
    # (tens of ms on either engine). Not "first < 0.7 × last": a slow first token on a busy host
    # (0.15 s, then 47 tokens in 0.05 s) failed that without any buffering.
    assert last - first > 0.010, f"first chunk at {first:.3f}s, last at {last:.3f}s: looks buffered"


def test_completion_stream_with_usage(client):
    stream = client.completions.create(model="demo", prompt="The model", stream=True, max_tokens=20,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert text
    assert len(usage) == 1 and usage[0].completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_non_streamed_usage_counts_the_tokens_produced(client):
    resp = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Count"}], max_tokens=17,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    produced = resp.choices[0].logprobs.content
    assert resp.usage.completion_tokens == len(produced) == 17
    assert resp.usage.prompt_tokens > 0
    assert resp.choices[0].finish_reason == "length"
    assert all(len(p.top_logprobs) == 2 for p in produced)


def test_models_lists_live_served_name_with_its_context(client, stack):
    context = stack.worker_info()["max_model_len"]
    assert [(m.id, m.max_model_len) for m in client.models.list().data] == [("demo", context)]
    assert client.models.retrieve("demo").max_model_len == context


LONG_TEXT = "lorem ipsum dolor " * 1000  # over 2,048 tokens (the tiny model's context) by any count


def test_a_stream_over_the_context_is_a_400_before_any_byte(client, stack):
    """Only the worker can count a text prompt's tokens: the gateway waits for its verdict."""
    context = stack.worker_info()["max_model_len"]
    calls = [(lambda: client.completions.create(model="demo", prompt=LONG_TEXT, max_tokens=8, stream=True),
              "+ max_tokens (8)"),
             (lambda: client.chat.completions.create(  # and without max_tokens: not named as if it were 1
                 model="demo", messages=[{"role": "user", "content": LONG_TEXT}], stream=True),
              "the request set no max_tokens")]
    for call, says in calls:
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert refused.value.code == "context_length_exceeded" and str(context) in refused.value.message
        assert says in refused.value.message
        assert refused.value.response.headers["content-type"] == "application/json"
        assert refused.value.response.headers["x-kvgate-version"] == "v1"


SYMBOLS = "Ω≈ç√∫˜µ≤≥÷"  # a prompt after which the tiny model ranks several byte tokens high


def test_top_logprobs_keep_every_entry_even_when_texts_repeat(client):
    text = client.completions.create(model="demo", prompt=SYMBOLS, max_tokens=48, logprobs=5,
                                     temperature=0, extra_body={"ignore_eos": True})
    tops = text.choices[0].logprobs.top_logprobs
    assert len(tops) == 48 and all(len(top) == 5 for top in tops)
    assert any(k.startswith("token_id:") for top in tops for k in top), "no texts repeated here"
    chat = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": SYMBOLS}], max_tokens=48, logprobs=True,
        top_logprobs=5, temperature=0, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 48 and all(len(p.top_logprobs) == 5 for p in content)
    assert any(len({t.token for t in p.top_logprobs}) < 5 for p in content), "no texts repeated here"
    entries = [t for p in content for t in [p, *p.top_logprobs]]
    assert any("\ufffd" in t.token for t in entries)
    for t in entries:  # each token's own bytes: a partial character's, not U+FFFD's
        assert bytes(t.bytes).decode(errors="replace") == t.token, t
        if "\ufffd" in t.token:
            with pytest.raises(UnicodeDecodeError):
                bytes(t.bytes).decode()


def _assert_openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    return err


def test_errors_have_openai_shape(stack):
    url = stack.url + "/v1/chat/completions"
    good = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    auth = {"Authorization": f"Bearer {stack.key}"}
    _assert_openai_error(httpx.post(url, json=good), 401)
    _assert_openai_error(httpx.post(url, json=good, headers={"Authorization": "Bearer sk-wrong"}), 401)
    err = _assert_openai_error(httpx.post(url, json={**good, "model": "nope"}, headers=auth), 404)
    assert err["param"] == "model"
    err = _assert_openai_error(httpx.post(url, json={"model": "demo"}, headers=auth), 422)
    assert err["param"] == "messages"
    err = _assert_openai_error(httpx.post(url, json={**good, "temperature": 9}, headers=auth), 422)
    assert err["param"] == "temperature"
    _assert_openai_error(httpx.post(url, content=b"{not json", headers={**auth, "Content-Type": "application/json"}), 422)
    _assert_openai_error(httpx.post(url, content=b"x" * (2 << 20), headers=auth), 413)


def test_health_routes_need_no_key(stack):
    assert httpx.get(stack.url + "/healthz").status_code == 200
    assert httpx.get(stack.url + "/readyz").status_code == 200


@pytest.fixture(scope="module", params=["paged", "hf"])
def cancel_at_once(request, tiny_model_dir, tmp_path_factory):
    """A stack whose gateway cancels a stream the moment its client leaves
    (KVGATE_RESUME_GRACE_S=0): with the default grace a 1,500-token request may finish first on a
    fast machine, and there is nothing left to abort (the grace has tests of its own, test_resume)."""
    s = start_stack(tiny_model_dir, tmp_path_factory.mktemp(f"no-grace-{request.param}"), request.param,
                    extra_env={"KVGATE_RESUME_GRACE_S": "0"})
    yield s
    stop_stack(s.proc)


def test_client_disconnect_aborts_the_request_on_the_worker(cancel_at_once):
    stack = cancel_at_once
    before = stack.worker_info()["requests_aborted"]
    body = {"model": "demo", "prompt": "Stream forever", "stream": True, "max_tokens": 1500,
            "ignore_eos": True}
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {stack.key}"}) as resp:
        assert resp.status_code == 200
        events = 0
        for line in resp.iter_lines():
            events += line.startswith("data: ")
            if events >= 3:
                break
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        info = stack.worker_info()
        if info["requests_aborted"] > before and info["active"] == 0 and info["stats"]["num_running"] == 0:
            return
        time.sleep(0.1)
    pytest.fail(f"worker did not abort the request: {stack.worker_info()}")
