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
async def client(redis_server):
    c = aioredis.Redis.from_url(redis_server.url)
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
