"""The batch runner on a real Redis and data folder, with a stand-in for the gateway (httpx's
MockTransport): line checks, retries, the output and error files, counts, cancel and expiry."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import orjson
import pytest
import redis.asyncio as aioredis

from services import batch as runner_mod
from services.batch import Runner
from services.batch_lines import parse_lines
from services.batch_results import Progress, result
from services.maintenance import tend_batches
from shared import names
from shared.batches import BatchStore, line_token, token_batch
from shared.files import FileStore
from shared.settings import ServicesSettings

ENDPOINT = "/v1/chat/completions"


def line(cid: str, **body) -> str:
    return orjson.dumps({"custom_id": cid, "method": "POST", "url": ENDPOINT,
                         "body": {"model": "demo", "messages": [{"role": "user", "content": cid}],
                                  **body}}).decode()


@pytest.fixture
async def env(redis_server, tmp_path, monkeypatch):
    monkeypatch.setattr(runner_mod, "BACKOFF_S", 0.01)
    monkeypatch.setattr(runner_mod, "WATCH_S", 0.05)
    client = aioredis.Redis.from_url(redis_server.url)
    settings = ServicesSettings(redis_url=redis_server.url, data_dir=tmp_path, secret="s3cret",
                                batch_concurrency=3, batch_max_attempts=3, batch_max_running=50)
    yield client, settings
    await client.aclose()


async def _batch(client, settings, lines: list[str], owner: str = "key_a"):
    files = FileStore(client, settings.data_dir, 3600)
    f = await files.create(owner, "in.jsonl", "batch", ("\n".join(lines) + "\n").encode())
    return await BatchStore(client).create(owner, ENDPOINT, f.id, "24h", None), files


def _completion(request: httpx.Request) -> httpx.Response:
    body = orjson.loads(request.content)
    return httpx.Response(200, headers={"x-request-id": "chatcmpl-1"}, json={
        "object": "chat.completion", "choices": [{"message": {"content": body["messages"][0]["content"]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})


def _error(status: int, code: str, retry_after: str | None = None) -> httpx.Response:
    headers = {"retry-after": retry_after} if retry_after else {}
    return httpx.Response(status, headers=headers, json={"error": {
        "message": code, "type": "x", "param": None, "code": code}})


async def _run(client, settings, batch, handler) -> tuple[str, object]:
    runner = Runner(settings, client, batch.id)
    runner.transport = httpx.MockTransport(handler)
    outcome = await runner.run()
    return outcome, await BatchStore(client).find(batch.id)


async def _lines(files: FileStore, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    record = await files.find(file_id)
    return [orjson.loads(x) for x in files.content_path(record).read_bytes().splitlines()]


def test_line_checks_name_the_reason():
    text = "\n".join([line("a"), "{oops", "[1]", orjson.dumps({"method": "POST"}).decode(), line("a"),
                      line("b").replace('"POST"', '"GET"'), line("c").replace(ENDPOINT, "/v1/completions"),
                      orjson.dumps({"custom_id": "d", "method": "POST", "url": ENDPOINT, "body": {}}).decode(),
                      line("e", stream=True), "", "   ", line("f")])
    parsed = parse_lines(text, ENDPOINT)
    assert [(p.number, p.error[0] if p.error else None) for p in parsed] == [
        (1, None), (2, "invalid_json"), (3, "invalid_request"), (4, "missing_custom_id"),
        (5, "duplicate_custom_id"), (6, "invalid_method"), (7, "mismatched_endpoint"),
        (8, "missing_model"), (9, "invalid_request"), (12, None)]
    assert parsed[4].custom_id == "a" and "Line 5" in parsed[4].error[1]


def test_a_line_token_names_its_batch_and_nothing_else():
    token = line_token("secret", "batch_1")
    assert token_batch("secret", token) == "batch_1"
    assert token_batch("other", token) is None
    assert token_batch("secret", token.replace("batch_1", "batch_2")) is None
    assert token_batch("secret", "sk-kvg-something") is None


async def test_transient_failures_are_retried_and_the_files_match_the_counts(env):
    client, settings = env
    batch, files = await _batch(client, settings, [line(f"r{i}") for i in range(6)] + ["{bad"]
                                + [line("x", temperature=9)])
    seen: dict[str, int] = {}

    def gateway(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == f"Bearer {line_token('s3cret', batch.id)}"
        cid = orjson.loads(request.content)["messages"][0]["content"]
        seen[cid] = seen.get(cid, 0) + 1
        if cid == "x":
            return _error(422, "invalid_value")
        if cid == "r1" and seen[cid] < 3:
            return _error(503, "service_unavailable", "0")
        if cid == "r2" and seen[cid] < 2:
            return _error(429, "rate_limit_exceeded", "0")
        if cid == "r3":
            return _error(503, "service_unavailable", "0")  # never recovers: out of attempts
        return _completion(request)

    outcome, done = await _run(client, settings, batch, gateway)
    assert done.status == "completed", outcome
    assert seen["r1"] == 3 and seen["r2"] == 2 and seen["r3"] == settings.batch_max_attempts
    assert done.request_counts.model_dump() == {"total": 8, "completed": 5, "failed": 3}
    assert (done.usage.input_tokens, done.usage.output_tokens) == (15, 10)
    out, err = await _lines(files, done.output_file_id), await _lines(files, done.error_file_id)
    assert sorted(o["custom_id"] for o in out) == ["r0", "r1", "r2", "r4", "r5"]
    assert all(o["response"]["body"]["choices"][0]["message"]["content"] == o["custom_id"] for o in out)
    assert {e["custom_id"]: (e["response"] or {}).get("status_code") for e in err} == \
        {None: None, "x": 422, "r3": 503}
    assert next(e for e in err if e["custom_id"] is None)["error"]["code"] == "invalid_json"
    assert done.status == "completed" and done.in_progress_at and done.finalizing_at and done.completed_at
    assert not await client.sismember(names.BATCHES_ACTIVE, batch.id)
    assert (await files.find(done.output_file_id)).owner == "key_a"


async def test_a_cancel_stops_outstanding_lines_and_keeps_what_completed(env):
    client, settings = env
    batch, files = await _batch(client, settings, [line(f"r{i}") for i in range(30)])
    store = BatchStore(client)
    answered = 0

    async def gateway(request: httpx.Request) -> httpx.Response:
        nonlocal answered
        if answered == 5:
            await store.move(batch.id, "cancelling", "in_progress")
        if answered >= 5:
            await asyncio.sleep(30)  # in flight when the cancel comes: abandoned
        answered += 1
        return _completion(request)

    start = time.monotonic()
    _, done = await _run(client, settings, batch, gateway)
    assert time.monotonic() - start < 5
    assert done.status == "cancelled" and done.cancelling_at and done.cancelled_at
    out = await _lines(files, done.output_file_id)
    assert done.request_counts.model_dump() == {"total": 30, "completed": 5, "failed": 0}
    assert len(out) == 5 and done.error_file_id is None


async def test_a_batch_past_its_window_expires_its_unrun_lines(env):
    client, settings = env
    batch, files = await _batch(client, settings, [line(f"r{i}") for i in range(10)])
    await client.hset(names.batch_record(batch.id), "record", orjson.dumps(
        {**orjson.loads(await client.hget(names.batch_record(batch.id), "record")),
         "expires_at": int(time.time()) + 1}))
    answered = 0

    async def gateway(request: httpx.Request) -> httpx.Response:
        nonlocal answered
        answered += 1
        if answered > 4:
            await asyncio.sleep(30)
        return _completion(request)

    _, done = await _run(client, settings, batch, gateway)
    assert done.status == "expired" and done.expired_at
    assert done.request_counts.model_dump() == {"total": 10, "completed": 4, "failed": 6}
    err = await _lines(files, done.error_file_id)
    assert {e["error"]["code"] for e in err} == {"batch_expired"}


async def test_a_missing_input_file_fails_the_batch(env):
    client, settings = env
    batch, files = await _batch(client, settings, [line("a")])
    await files.delete(await files.find(batch.input_file_id))
    _, done = await _run(client, settings, batch, _completion)
    assert done.status == "failed" and done.errors.data[0].code == "file_not_found"


async def test_a_runner_resumes_where_a_dead_one_stopped(env):
    client, settings = env
    batch, files = await _batch(client, settings, [line(f"r{i}") for i in range(6)])
    first = Runner(settings, client, batch.id)
    for parsed in parse_lines("\n".join(line(f"r{i}") for i in range(3)), ENDPOINT):
        first.progress.append(parsed.number, result(parsed, status=200, body={"usage": {}}))
    await BatchStore(client).move(batch.id, "in_progress", "validating")
    sent = []

    def gateway(request: httpx.Request) -> httpx.Response:
        sent.append(orjson.loads(request.content)["messages"][0]["content"])
        return _completion(request)

    assert batch.id in await tend_batches(client, lambda _: None)  # no runner holds it
    _, done = await _run(client, settings, batch, gateway)
    assert sorted(sent) == ["r3", "r4", "r5"]
    assert done.status == "completed" and done.request_counts.completed == 6


async def test_tend_starts_only_batches_no_runner_holds(env):
    client, settings = env
    store = BatchStore(client)
    held, _ = await _batch(client, settings, [line("a")])
    free, _ = await _batch(client, settings, [line("a")])
    assert await store.acquire(held.id, 30, 100) == 1
    started = []
    await tend_batches(client, started.append)
    assert free.id in started and held.id not in started
    await store.release(held.id)


async def test_a_batch_yields_to_interactive_traffic_and_widens_when_it_stops(env, monkeypatch):
    client, settings = env
    monkeypatch.setattr(runner_mod, "YIELD_POLL_S", 0.01)
    settings = settings.model_copy(update={"batch_concurrency": 4, "batch_concurrency_busy": 1})
    batch, _ = await _batch(client, settings, [line(f"r{i}") for i in range(40)])
    mark = names.interactive_mark("demo")
    await client.set(mark, "1", px=400)  # as the gateway does on an interactive request
    in_flight, widths, busy_starts = 0, [], []

    async def gateway(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight
        in_flight += 1
        marked = await client.exists(mark)
        widths.append((in_flight, marked))
        if marked:
            busy_starts.append(time.monotonic())
        await asyncio.sleep(0.02)
        in_flight -= 1
        return _completion(request)

    outcome, done = await _run(client, settings, batch, gateway)
    assert done.status == "completed", outcome
    busy = [w for w, marked in widths if marked]
    free = [w for w, marked in widths if not marked]
    assert busy and max(busy) == 1  # one line at a time while people are served: it still moves
    gaps = [b - a for a, b in zip(busy_starts, busy_starts[1:])]
    # and it sends a quarter of the time (batch_busy_duty): a 0.02 s line, then a 0.06 s rest
    assert len(gaps) >= 2 and min(gaps) >= 0.07
    assert free and max(free) == 4  # full width once the mark has expired


async def test_results_are_written_in_input_order_and_charged_to_the_owners_quota(env):
    client, settings = env
    owner = "key_results"
    batch, files = await _batch(client, settings, [line(f"r{i}") for i in range(9)] + ["{bad"],
                                owner=owner)

    async def gateway(request: httpx.Request) -> httpx.Response:
        cid = orjson.loads(request.content)["messages"][0]["content"]
        await asyncio.sleep(0.01 * (9 - int(cid[1:])))  # later lines answer first
        return _completion(request)

    _, done = await _run(client, settings, batch, gateway)
    out = await _lines(files, done.output_file_id)
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(9)]
    assert not (Path(settings.data_dir) / "batches" / f"{batch.id}.jsonl").exists()
    made = [await files.find(i) for i in (batch.input_file_id, done.output_file_id, done.error_file_id)]
    usage = await files.quota.usage(owner)
    assert (usage.bytes, usage.files, usage.batches) == (sum(f.bytes for f in made), 3, 0)


async def test_a_record_cut_short_by_a_crash_does_not_swallow_the_next(env, tmp_path):
    progress = Progress(tmp_path / "p.jsonl")
    [first, second] = parse_lines(line("a") + "\n" + line("b"), ENDPOINT)
    progress.append(first.number, result(first, status=200, body={}))
    with open(progress.path, "ab") as f:
        f.write(b'{"line": 2, "resu')  # the runner died mid-write
    assert set(progress.index()) == {1}
    progress.append(second.number, result(second, status=200, body={}))
    index = progress.index()
    assert set(index) == {1, 2}
    with open(progress.path, "rb") as f:
        assert Progress.read(f, index[2])["custom_id"] == "b"


async def test_tend_sends_no_more_while_as_many_messages_wait(env):
    from shared.batches import BATCH_QUEUE

    client, settings = env
    waiting, _ = await _batch(client, settings, [line("a")])
    queue = names.celery_queue(BATCH_QUEUE)
    idle = len(await tend_batches(client, lambda _: None))
    assert waiting.id in await tend_batches(client, lambda _: None)
    await client.rpush(queue, *[b"{}"] * idle)  # a stopped Celery worker: its messages pile up
    try:
        assert await tend_batches(client, lambda _: None) == []
    finally:
        await client.delete(queue)


async def test_lines_are_read_back_as_they_are_sent_even_if_the_input_file_is_deleted(env):
    client, settings = env
    batch, files = await _batch(client, settings, [line(f"r{i}") for i in range(6)])
    sent = []

    async def gateway(request: httpx.Request) -> httpx.Response:
        if not sent:
            await files.delete(await files.find(batch.input_file_id))
        sent.append(orjson.loads(request.content)["messages"][0]["content"])
        return _completion(request)

    _, done = await _run(client, settings, batch, gateway)
    assert done.status == "completed" and sorted(sent) == [f"r{i}" for i in range(6)]


async def test_a_batch_stops_sending_once_its_results_take_what_the_quota_left(env):
    """Results count against the owner's byte quota: once they take what it left when the batch
    started, the remaining lines are not sent (quota_exceeded each), and what came back is kept.
    Without it, a key's batches wrote results as fast as the fleet made them, past any quota."""
    from shared.quota import QuotaLimits

    client, settings = env
    owner, sent = "key_quota", []
    files = FileStore(client, settings.data_dir, 3600)
    source = await files.create(owner, "in.jsonl", "batch",
                                ("\n".join(line(f"q{i}") for i in range(20)) + "\n").encode())
    room = 5000  # ~2 results of ~2 KB each
    batch = await BatchStore(client).create(owner, ENDPOINT, source.id, "24h", None,
                                            QuotaLimits(owner, bytes=source.bytes + room))

    async def gateway(request: httpx.Request) -> httpx.Response:
        sent.append(orjson.loads(request.content)["messages"][0]["content"])
        await asyncio.sleep(0.01)
        return httpx.Response(200, json={"object": "chat.completion",
                                         "choices": [{"message": {"content": "x" * 2000}}],
                                         "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                                   "total_tokens": 5}})

    outcome, done = await _run(client, settings, batch, gateway)
    out, errors = await _lines(files, done.output_file_id), await _lines(files, done.error_file_id)
    assert outcome.startswith("completed") and len(out) + len(errors) == 20
    assert 2 <= len(out) == len(sent) <= 2 + settings.batch_concurrency  # those in flight finish
    assert {e["error"]["code"] for e in errors} == {"quota_exceeded"}
    assert "max_stored_bytes" in errors[0]["error"]["message"]
    assert sorted(o["custom_id"] for o in out) == sorted(sent)  # nothing that came back was lost
    assert (done.request_counts.completed, done.request_counts.failed) == (len(out), len(errors))
    assert "max_stored_bytes" not in done.public().model_dump()
