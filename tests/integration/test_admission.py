"""Streams and what is known before their first byte, through `kvgate up` and the openai client: a
refusal is an HTTP error; a request queued past KVGATE_ADMISSION_WAIT_S gets its 200 then and
streams later (a refusal after that is an SSE error event); a request without max_tokens reserves
the documented default and is charged what it used.

One slot (KVGATE_MAX_NUM_SEQS=1), so a request can be queued behind another; a 768-token context,
so a request without max_tokens ends within seconds."""
from __future__ import annotations

import secrets
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from gateway import estimate
from tests.conftest import start_stack, stop_stack

WAIT_S = 0.3
DEFAULT_RESERVE = 100
CONTEXT = 768
ENV = {"KVGATE_ADMISSION_WAIT_S": str(WAIT_S), "KVGATE_DEFAULT_RESERVE_TOKENS": str(DEFAULT_RESERVE),
       "KVGATE_MAX_NUM_SEQS": "1", "KVGATE_MAX_MODEL_LEN": str(CONTEXT)}


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    s = start_stack(tiny_model_dir, tmp_path_factory.mktemp("admission"), "paged", extra_env=ENV)
    yield s
    stop_stack(s.proc)


def _admin(stack, method: str, path: str, **kwargs) -> httpx.Response:
    admin_key = (stack.state / "admin.key").read_text().strip()
    return httpx.request(method, stack.url + path, timeout=30, **kwargs,
                         headers={"Authorization": f"Bearer {admin_key}"})


def _client(stack, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key or stack.key, max_retries=0,
                         timeout=60)


def test_the_context_is_the_workers(stack):
    assert stack.worker_info()["max_model_len"] == CONTEXT
    assert _client(stack).models.retrieve("demo").max_model_len == CONTEXT


@pytest.mark.parametrize("stream", [True, False])
def test_a_completion_the_worker_refuses_is_a_400_before_any_byte_and_costs_no_tokens(stack, stream):
    """max_tokens = the context - 1 passes the gateway's check, the prompt's tokens do not fit with
    it: only the worker, which counts them, can refuse it; nothing ran, so nothing is charged."""
    tpm = 1_000_000
    made = _admin(stack, "POST", "/admin/keys", json={"name": "refused-" + secrets.token_hex(3), "tpm": tpm})
    client = _client(stack, made.json()["secret"])
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="demo", prompt="Hello", max_tokens=CONTEXT - 1, stream=stream)
    assert refused.value.code == "context_length_exceeded"
    assert f"exceeds max_model_len of {CONTEXT} tokens" in refused.value.message
    deadline = time.monotonic() + 10  # the settlement runs when the response has ended
    while time.monotonic() < deadline:
        remaining = int(client.models.with_raw_response.list().headers["x-ratelimit-remaining-tokens"])
        if remaining == tpm:
            break
        time.sleep(0.1)
    assert remaining == tpm, f"a refused request was charged {tpm - remaining} tokens"


def test_a_chat_without_max_tokens_reserves_the_default_and_is_charged_what_it_used(stack):
    tpm = 1_000_000
    name = "nomax-" + secrets.token_hex(3)
    made = _admin(stack, "POST", "/admin/keys", json={"name": name, "tpm": tpm})
    assert made.status_code == 201, made.text
    client = _client(stack, made.json()["secret"])
    messages = [{"role": "user", "content": "Tell me a long story"}]
    raw = client.chat.completions.with_raw_response.create(
        model="demo", messages=messages, stream=True, stream_options={"include_usage": True})
    reserved = tpm - int(raw.headers["x-ratelimit-remaining-tokens"])
    assert reserved == estimate.prompt_tokens({"messages": messages}) + DEFAULT_RESERVE
    chunks = list(raw.parse())
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    [usage] = [c.usage for c in chunks if c.usage is not None]
    assert finish in (["length"], ["stop"]) and usage.total_tokens <= CONTEXT
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
    deadline = time.monotonic() + 10  # the settlement runs when the response has ended
    while time.monotonic() < deadline:
        remaining = int(client.models.with_raw_response.list().headers["x-ratelimit-remaining-tokens"])
        if remaining == tpm - usage.total_tokens:
            break
        time.sleep(0.1)
    assert remaining == tpm - usage.total_tokens, "the reservation was not settled to the usage"
    rows = _admin(stack, "GET", "/admin/usage", params={"key": name, "since": "1d"}).json()["rows"]
    assert [(r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [
        (usage.prompt_tokens, usage.completion_tokens)]


def _timed_create(client: openai.OpenAI, **body):
    """The stream and when its headers came."""
    stream = client.completions.create(model="demo", stream=True, **body)
    return stream, time.monotonic()


def test_a_request_queued_past_the_wait_gets_its_200_then_streams(stack):
    client = _client(stack)
    busy = iter(client.completions.create(model="demo", prompt="Hello", max_tokens=CONTEXT - 8,
                                          stream=True, extra_body={"ignore_eos": True}))
    next(busy)  # it holds the one slot now, for a few seconds

    def busy_ends() -> float:
        assert [c.choices[0].finish_reason for c in busy][-1] == "length"
        return time.monotonic()

    with ThreadPoolExecutor(3) as pool:
        start = time.monotonic()
        ended = pool.submit(busy_ends)
        ok = pool.submit(_timed_create, client, prompt="Queued", max_tokens=8,
                         extra_body={"ignore_eos": True})
        late = pool.submit(_timed_create, client, prompt="Hello", max_tokens=CONTEXT - 1)
        (queued, queued_at), (refused, refused_at) = ok.result(), late.result()
        chunks = list(queued)
        busy_end = ended.result()
    assert min(queued_at, refused_at) - start >= WAIT_S * 0.9, "a 200 came before the wait was over"
    assert max(queued_at, refused_at) < busy_end, "the 200s waited for the request ahead"
    assert "".join(c.choices[0].text for c in chunks) and chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.APIError) as error:  # refused past the wait: an SSE error event
        list(refused)
    assert "exceeds max_model_len" in error.value.message


def test_models_report_the_context_of_the_version_the_key_is_routed_to(stack, tiny_model_dir):
    """Last here: it adds a canary version (512-token context) that one cohort is pinned to."""
    log = open(stack.state / "worker-v2.log", "ab")
    v2 = subprocess.Popen([sys.executable, "-m", "kvgate", "worker", "--model", str(tiny_model_dir),
                           "--served-name", "demo", "--version", "v2", "--max-model-len", "512", "--redis-url",
                           stack.redis_url], stdout=log, stderr=subprocess.STDOUT,
                          start_new_session=True)
    try:
        route = {"version": "v2", "stable": "v1", "weight": 0, "cohorts": {"beta": "v2"}}
        deadline = time.monotonic() + 120
        while (put := _admin(stack, "PUT", "/admin/canary/demo", json=route)).status_code == 404:
            assert v2.poll() is None and time.monotonic() < deadline, "v2 never registered"
            time.sleep(0.2)  # a cohort may be pinned only to a version a worker has served
        assert put.status_code == 200, put.text
        made = _admin(stack, "POST", "/admin/keys", json={"name": "beta-" + secrets.token_hex(3),
                                                          "canary_cohort": "beta"})
        beta = _client(stack, made.json()["secret"])
        while (seen := beta.models.retrieve("demo").max_model_len) != 512:
            assert v2.poll() is None and time.monotonic() < deadline, f"v2 never served: {seen}"
            time.sleep(0.2)
        assert [m.max_model_len for m in beta.models.list().data] == [512]
        assert _client(stack).models.retrieve("demo").max_model_len == CONTEXT  # stable: v1's
    finally:
        v2.send_signal(signal.SIGTERM)
        v2.wait(30)
