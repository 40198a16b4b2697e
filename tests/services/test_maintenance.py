"""Maintenance on a real Redis: dead workers leave the registry and the streams' groups (unless
entries are pending on them), files past their expiry are deleted, bytes and record."""
from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis

from services.maintenance import reap_workers
from shared import names
from shared.files import FileStore


@pytest.fixture
async def client():
    """A Redis of its own: the roll-up and the reports read every usage key there is, and the
    session's shared Redis holds other tests' usage (a 'demo' error of today, for one)."""
    from shared.redis_server import RedisServer

    with RedisServer() as server:
        c = aioredis.Redis.from_url(server.url)
        yield c
        await c.aclose()


async def test_dead_workers_leave_the_registry_and_idle_consumers_the_groups(client):
    stream = names.request_stream("reap", "v1", names.BATCH_LANE)
    await client.xgroup_create(stream, names.CONSUMER_GROUP, id="0", mkstream=True)
    for worker in ("live", "dead-idle", "dead-pending"):
        await client.xadd(stream, {"m": b"x"})
        await client.xreadgroup(names.CONSUMER_GROUP, worker, {stream: ">"}, count=1)
    for worker in ("live", "dead-idle"):  # their entries are done
        pending = await client.xpending_range(stream, names.CONSUMER_GROUP, "-", "+", 10, worker)
        await client.xack(stream, names.CONSUMER_GROUP, *[p["message_id"] for p in pending])
    await client.set(names.worker_key("live"), b"{}", ex=10)
    await client.zadd(names.WORKERS_ZSET, {"live": time.time() + 10, "gone": time.time() - 1})

    reaped = await reap_workers(client)

    assert reaped["registry_members"] >= 1 and await client.zscore(names.WORKERS_ZSET, "gone") is None
    left = {c["name"].decode() for c in await client.xinfo_consumers(stream, names.CONSUMER_GROUP)}
    assert left == {"live", "dead-pending"}  # takeover still owes dead-pending's entry a worker


async def test_expired_files_are_deleted(client, tmp_path):
    files = FileStore(client, tmp_path, retention_s=3600)
    old = await files.create("key_x", "old.jsonl", "batch", b"{}\n")
    new = await files.create("key_x", "new.jsonl", "batch", b"{}\n")
    assert await files.expire(now=old.expires_at + 1) >= 1  # both are due by then ...
    assert await files.find(old.id) is None and not files.path(old.id).exists()
    assert await files.find(new.id) is None  # ... and so is the second one
    kept = await files.create("key_x", "kept.jsonl", "batch", b"{}\n")
    await files.expire()
    assert await files.find(kept.id) is not None
    assert [r.id for r in (await files.list("key_x"))[0]] == [kept.id]


async def test_finished_days_fold_into_one_hash_and_reports_read_it(client):
    from shared.usage import ROLLUP_GRACE_S, UsageBook, fold, utc_day

    book = UsageBook(client, retention_days=3)
    now = time.time()
    yesterday, today = now - 86400, now
    for key_id, model, usage in (("key_a", "m|x", {"prompt_tokens": 3, "completion_tokens": 5}),
                                 ("key_a", "demo", None),
                                 ("key_b", "demo", {"prompt_tokens": 7, "completion_tokens": 1})):
        await book.record(key_id, model, "v1", usage, now=yesterday)
    await book.record("key_b", "demo", "v1", {"prompt_tokens": 2, "completion_tokens": 2}, now=today)
    since = yesterday - 1
    scanned = {by: await book.query(since, None, by) for by in ("model", "day", "key")}

    assert await fold(client, now=now - now % 86400 + ROLLUP_GRACE_S - 1) == []  # yesterday: grace
    assert await fold(client, now=now - now % 86400 + ROLLUP_GRACE_S + 1) == [utc_day(yesterday)]
    assert await fold(client, now=now - now % 86400 + ROLLUP_GRACE_S + 1) == []  # folded once
    rollup = names.usage_rollup(utc_day(yesterday))
    assert 0 < await client.ttl(rollup) <= 3 * 86400
    assert await client.exists(names.usage_rollup(utc_day(today))) == 0  # today is not over

    # the reports now read the roll-up: the per-key hashes of yesterday no longer matter to them
    for key_id in ("key_a", "key_b"):
        await client.rename(names.usage_key(key_id, utc_day(yesterday)), f"moved:{key_id}")
    for by, rows in scanned.items():
        assert await book.query(since, None, by) == rows, by
    model_rows = {(r["model"], r["version"]): r for r in scanned["model"]}
    assert model_rows[("m|x", "v1")]["total_tokens"] == 8 and model_rows[("demo", "v1")]["errors"] == 1
    for key_id in ("key_a", "key_b"):
        await client.rename(f"moved:{key_id}", names.usage_key(key_id, utc_day(yesterday)))

    # a record that lands on a folded day (a gateway whose clock is far behind) is folded again
    await book.record("key_a", "demo", "v1", {"prompt_tokens": 100, "completion_tokens": 0}, now=yesterday)
    assert await fold(client, now=now - now % 86400 + ROLLUP_GRACE_S + 1) == [utc_day(yesterday)]
    by_key = {r["key_id"]: r for r in await book.query(since, None, "key")}
    assert by_key["key_a"]["prompt_tokens"] == 103 and by_key["key_b"]["prompt_tokens"] == 9


async def test_partial_files_of_dead_uploads_are_swept(client, tmp_path):
    import os

    from shared.files import ABANDONED_S

    files = FileStore(client, tmp_path, retention_s=3600)
    stale, fresh = files.begin("key_x", "batch"), files.begin("key_x", "batch")
    for new in (stale, fresh):
        new.write(b"{}\n")
        new.close()
    old = time.time() - ABANDONED_S - 1
    os.utime(stale.tmp, (old, old))
    await files.expire()
    assert not stale.tmp.exists() and fresh.tmp.exists()
