"""Batch jobs end to end: `kvgate up` (paged engine; Celery worker and beat), the official `openai`
client for /v1/files and /v1/batches, the `kvgate batches` CLI, keys made through the admin API."""
from __future__ import annotations

import io
import os
import secrets
import statistics
import subprocess
import sys
import time

import httpx
import openai
import orjson
import pytest
import redis

from shared import names
from tests.conftest import Stack, start_stack, stop_stack

ENV = {"KVGATE_MAINTENANCE_S": "2", "KVGATE_MAX_FILE_BYTES": "400000", "KVGATE_MAX_FILE_LINES": "2000"}
FINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    s = start_stack(tiny_model_dir, tmp_path_factory.mktemp("batches") / ".kvgate", "paged", ENV)
    yield s
    stop_stack(s.proc)


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.key, max_retries=0)


def _admin(stack: Stack, method: str, path: str, **kwargs) -> httpx.Response:
    admin = (stack.state / "admin.key").read_text().strip()
    return httpx.request(method, stack.url + path, headers={"Authorization": f"Bearer {admin}"},
                         **kwargs)


def _admin_key(stack: Stack, **fields) -> str:
    resp = _admin(stack, "POST", "/admin/keys", json={"name": "b-" + secrets.token_hex(4), **fields})
    assert resp.status_code == 201, resp.text
    return resp.json()["secret"]


def _request(cid: str, endpoint: str = "/v1/chat/completions", max_tokens: int = 2, **body) -> dict:
    if endpoint == "/v1/chat/completions":
        body.setdefault("messages", [{"role": "user", "content": f"say {cid}"}])
    else:
        body.setdefault("prompt", f"say {cid} " * 4)
    # ignore_eos: a random model samples its EOS now and then (1 in ~2,000 tokens), and the tests
    # count every line's tokens exactly
    return {"custom_id": cid, "method": "POST", "url": endpoint,
            "body": {"model": "demo", "max_tokens": max_tokens, "ignore_eos": True, **body}}


def _jsonl(lines: list) -> bytes:
    return b"".join((ln if isinstance(ln, bytes) else orjson.dumps(ln)) + b"\n" for ln in lines)


def _submit(client: openai.OpenAI, lines: list, endpoint: str = "/v1/chat/completions", **extra):
    f = client.files.create(file=("input.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h",
                                 **extra)


def _wait(client: openai.OpenAI, batch_id: str, timeout: float = 120.0, until=FINAL):
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in until:
        assert time.monotonic() < deadline, f"batch stuck: {batch}"
        time.sleep(0.3)
    return batch


def _content(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [orjson.loads(x) for x in client.files.content(file_id).text.splitlines()] if file_id else []


def _cli(stack: Stack, *args: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("KVGATE_URL", "KVGATE_API_KEY")}
    out = subprocess.run([sys.executable, "-m", "kvgate", "batches", *args], cwd=stack.state.parent,
                         env=clean, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stdout + out.stderr
    return out.stdout


def test_the_openai_client_runs_a_200_line_batch(stack, client):
    lines = [_request(f"line-{i}") for i in range(200)]
    batch = _submit(client, lines, metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = _wait(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.model_dump() == {"total": 200, "completed": 200, "failed": 0}
    assert done.error_file_id is None and done.model == "demo"
    assert done.usage.output_tokens == 400 and done.usage.input_tokens > 0
    out = _content(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"line-{i}" for i in range(200))
    for o in out:
        assert o["id"].startswith("batch_req_") and o["error"] is None
        assert o["response"]["status_code"] == 200
        body = o["response"]["body"]
        assert body["object"] == "chat.completion" and body["id"] == o["response"]["request_id"]
        assert body["usage"]["completion_tokens"] == 2
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert batch.id in [b.id for b in client.batches.list()]

    listed = _cli(stack, "list")
    assert batch.id in listed and "completed" in listed
    shown = _cli(stack, "show", batch.id, "--follow", "--interval", "0.2")
    assert "200/200" in shown and "200 completed, 0 failed, 200 in all" in shown, shown


def test_malformed_lines_land_in_the_error_file_and_the_rest_complete(client):
    good = [_request(f"ok-{i}") for i in range(6)]
    bad = [b"{not json", {"method": "POST", "url": "/v1/chat/completions", "body": {}},
           _request("ok-0"),  # a duplicate custom_id
           {**_request("wrong-url"), "url": "/v1/completions"},
           {**_request("no-model"), "body": {"messages": []}},
           _request("streamed", stream=True),
           _request("too-hot", temperature=7)]  # refused by the gateway's own validation (422)
    done = _wait(client, _submit(client, good[:3] + bad + good[3:]).id)
    assert done.status == "completed", done
    assert done.request_counts.model_dump() == {"total": 13, "completed": 6, "failed": 7}
    assert sorted(o["custom_id"] for o in _content(client, done.output_file_id)) == \
        [f"ok-{i}" for i in range(6)]
    errors = {(e["custom_id"], (e["error"] or {}).get("code") or e["response"]["status_code"])
              for e in _content(client, done.error_file_id)}
    assert errors == {(None, "invalid_json"), (None, "missing_custom_id"), ("ok-0", "duplicate_custom_id"),
                      ("wrong-url", "mismatched_endpoint"), ("no-model", "missing_model"),
                      ("streamed", "invalid_request"), ("too-hot", 422)}


def test_a_model_name_longer_than_the_gateway_takes_never_becomes_the_batchs_model(client):
    # the batch's model is copied from its lines into its record, kept and listed for 30 days: a
    # name as long as the file (any number of batches of one file) grew Redis outside every quota
    huge = {**_request("huge"), "body": {**_request("huge")["body"], "model": "m" * 300_000}}
    done = _wait(client, _submit(client, [huge, _request("fine")]).id)
    assert done.model == "demo" and done.request_counts.model_dump() == {
        "total": 2, "completed": 1, "failed": 1}
    [error] = _content(client, done.error_file_id)
    assert error["custom_id"] == "huge" and error["error"]["code"] == "invalid_model"
    assert "256 characters" in error["error"]["message"]


def test_lines_are_governed_as_the_owners_requests(stack):
    other_model = openai.OpenAI(base_url=stack.url + "/v1", max_retries=0,
                                api_key=_admin_key(stack, models=["not-demo"]))
    done = _wait(other_model, _submit(other_model, [_request(f"m{i}") for i in range(3)]).id)
    assert done.request_counts.model_dump() == {"total": 3, "completed": 0, "failed": 3}
    assert {e["response"]["status_code"] for e in _content(other_model, done.error_file_id)} == {403}

    # a daily budget of 100 tokens: the lines that fit run, the rest are refused with its code
    name = "budget-" + secrets.token_hex(3)
    budget = openai.OpenAI(base_url=stack.url + "/v1", max_retries=0,
                           api_key=_admin_key(stack, name=name, daily_tokens=100))
    done = _wait(budget, _submit(budget, [_request(f"b{i}", max_tokens=8) for i in range(12)]).id)
    counts = done.request_counts
    assert 0 < counts.completed < 12 and counts.completed + counts.failed == 12, done
    refusals = {e["response"]["body"]["error"]["code"] for e in _content(budget, done.error_file_id)}
    assert refusals == {"insufficient_quota"}
    usage = _admin(stack, "GET", "/admin/usage", params={"key": name, "since": "1d"}).json()["rows"]
    assert sum(r["completion_tokens"] for r in usage) == done.usage.output_tokens  # charged to the key
    assert sum(r["prompt_tokens"] for r in usage) == done.usage.input_tokens


def test_files_belong_to_their_key_and_limits_name_themselves(stack, client):
    batch = _wait(client, _submit(client, [_request("mine")]).id)
    stranger = openai.OpenAI(base_url=stack.url + "/v1", api_key=_admin_key(stack), max_retries=0)
    for call in (lambda: stranger.files.retrieve(batch.input_file_id),
                 lambda: stranger.files.content(batch.output_file_id),
                 lambda: stranger.batches.retrieve(batch.id),
                 lambda: stranger.batches.cancel(batch.id),
                 lambda: stranger.files.delete(batch.output_file_id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [b.id for b in stranger.batches.list()]
    assert batch.input_file_id not in [f.id for f in stranger.files.list()]
    with pytest.raises(openai.NotFoundError):
        stranger.batches.create(input_file_id=batch.input_file_id, endpoint="/v1/chat/completions",
                                completion_window="24h")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.url + "/v1", api_key="nope", max_retries=0).files.list()

    with pytest.raises(openai.APIStatusError) as big:
        client.files.create(file=("big.jsonl", io.BytesIO(b"x" * 400_001)), purpose="batch")
    assert big.value.status_code == 413 and "400000 bytes" in big.value.message
    with pytest.raises(openai.BadRequestError) as many:
        client.files.create(file=("many.jsonl", io.BytesIO(b"{}\n" * 2001)), purpose="batch")
    assert "2001 lines" in many.value.message and "2000 lines" in many.value.message
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")

    assert client.files.delete(batch.output_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(batch.output_file_id)


def _ttft_ms(http: httpx.Client) -> float:
    time.sleep(0.05)  # samples spread over ~1 s: lines already in flight finish, new ones are paced
    start = time.perf_counter()
    body = {"model": "demo", "prompt": "Hello there", "max_tokens": 4, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                return (time.perf_counter() - start) * 1000
    raise AssertionError("no token")


# The default shape (8 lines in flight, settings' default) with lines that are nearly all prompt, the
# costliest per token for the gateway and the engine; and decode-heavy lines.
SHAPES = {"short-chat-lines": ("/v1/chat/completions", 2, 1500), "long-completions": ("/v1/completions", 48, 300)}


@pytest.mark.parametrize("shape", SHAPES)
def test_interactive_ttft_holds_while_a_batch_runs_and_a_cancel_leaves_it_consistent(stack, client, shape):
    endpoint, max_tokens, num_lines = SHAPES[shape]
    http = httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.key}"}, timeout=60)
    _ttft_ms(http)  # warm
    idle = [_ttft_ms(http) for _ in range(9)]
    lines = [_request(f"{shape}-{i}", endpoint, max_tokens=max_tokens, ignore_eos=True)
             for i in range(num_lines)]
    batch = _submit(client, lines, endpoint=endpoint)
    _wait(client, batch.id, until=("in_progress",) + FINAL)
    while client.batches.retrieve(batch.id).request_counts.completed < 4:
        time.sleep(0.1)
    start, before = time.monotonic(), client.batches.retrieve(batch.id).request_counts.completed
    busy = [_ttft_ms(http) for _ in range(15)]
    running = client.batches.retrieve(batch.id)

    busy_rate = (running.request_counts.completed - before) / (time.monotonic() - start)
    assert running.status == "in_progress" and running.request_counts.completed < num_lines
    cancelled = _cli(stack, "cancel", batch.id)
    assert "cancel" in cancelled
    done = _wait(client, batch.id, timeout=30)
    idle += [_ttft_ms(http) for _ in range(4)]  # after the batch: the load around may have changed

    idle_ms, busy_ms = statistics.median(idle), statistics.median(busy)
    print(f"\ninteractive TTFT: idle median {idle_ms:.1f} ms {sorted(round(x) for x in idle)}; "
          f"during the batch median {busy_ms:.1f} ms {sorted(round(x) for x in busy)}; "
          f"ratio {busy_ms / idle_ms:.2f}; batch lines/s meanwhile {busy_rate:.1f}")
    assert busy_ms <= 2 * idle_ms

    assert done.status == "cancelled" and done.cancelled_at and done.completed_at is None
    counts = done.request_counts
    out, err = _content(client, done.output_file_id), _content(client, done.error_file_id)
    assert counts.total == num_lines and counts.completed + counts.failed < num_lines
    assert counts.completed == len(out) >= running.request_counts.completed and counts.failed == len(err)
    assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["choices"] for o in out)
    time.sleep(1.5)
    assert client.batches.retrieve(batch.id).request_counts == counts  # nothing lands afterwards
    info = stack.worker_info()
    assert info["active"] == 0
    # (no count of aborted lines: the runner holds its lines back while the interactive probes run,
    # so at the cancel none may be in flight; the probes, streams, are not cancelled when they leave,
    # since a resume may come within KVGATE_RESUME_GRACE_S; the worker idle, nothing landing after
    # the cancel and the empty batch stream are what a consistent cancel leaves)
    r = redis.Redis.from_url(stack.redis_url)
    assert r.xlen(names.request_stream("demo", "v1", names.BATCH_LANE)) == 0
    r.close()


def test_a_line_token_only_sends_lines_of_its_running_batch(stack):
    from shared.batches import line_token

    admin = openai.OpenAI(base_url=stack.url + "/v1", max_retries=0,
                          api_key=(stack.state / "admin.key").read_text().strip())
    batch = _wait(admin, _submit(admin, [_request("one")]).id)  # made by an admin key
    secret = (stack.state / "server.secret").read_text().strip()
    token = {"Authorization": f"Bearer {line_token(secret, batch.id)}"}
    body = {"model": "demo", "prompt": "hi", "max_tokens": 1}
    done = httpx.post(f"{stack.url}/v1/completions", json=body, headers=token)
    assert done.status_code == 401 and done.json()["error"]["code"] == "batch_not_running"
    forged = {"Authorization": f"Bearer {line_token('not-the-secret', batch.id)}"}
    assert httpx.post(f"{stack.url}/v1/completions", json=body, headers=forged).status_code == 401
    r = redis.Redis.from_url(stack.redis_url)  # as if it ran: still no way into files or /admin
    r.hset(names.batch_record(batch.id), "status", "in_progress")
    try:
        assert httpx.get(f"{stack.url}/v1/files", headers=token).status_code == 403
        assert httpx.get(f"{stack.url}/admin/keys", headers=token).status_code == 403
        assert httpx.post(f"{stack.url}/v1/completions", json=body, headers=token).status_code == 200
    finally:
        r.hset(names.batch_record(batch.id), "status", "completed")
        r.close()


def test_beat_rolls_up_a_finished_days_usage_and_the_report_reads_it(stack):
    import asyncio

    import redis.asyncio as aioredis

    from shared.usage import UsageBook, utc_day

    yesterday = time.time() - 86400

    async def seed():  # a day that is over, as a gateway would have recorded it
        client = aioredis.Redis.from_url(stack.redis_url)
        await UsageBook(client, retention_days=3).record("key_rollup", "demo", "v1",
                                       {"prompt_tokens": 11, "completion_tokens": 4}, now=yesterday)
        await client.aclose()

    asyncio.run(seed())
    r = redis.Redis.from_url(stack.redis_url)
    deadline = time.monotonic() + 30
    while not r.exists(names.usage_rollup(utc_day(yesterday))):  # beat runs every 2 s here
        assert time.monotonic() < deadline, "Celery beat did not fold yesterday's usage"
        time.sleep(0.2)
    r.rename(names.usage_key("key_rollup", utc_day(yesterday)), "moved")  # the report must not need it
    report = _admin(stack, "GET", "/admin/usage", params={"since": "2d", "by": "key"}).json()
    r.rename("moved", names.usage_key("key_rollup", utc_day(yesterday)))
    r.close()
    row = next(x for x in report["rows"] if x["key_id"] == "key_rollup")
    assert (row["prompt_tokens"], row["completion_tokens"], row["requests"]) == (11, 4, 1)
