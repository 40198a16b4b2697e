"""The cluster part of /metrics (no key needed) lists served names from their set, on a real Redis:
a scrape reads what the deployment serves, never the whole keyspace; a name with no live worker is
still listed (its `kvgate_workers_live` 0 is the alert), and a Redis whose workers came before the
set is scanned instead. A worker's heartbeat keeps its name in the set."""
from __future__ import annotations

import secrets
import time

import orjson
import pytest
import redis
import redis.asyncio as aioredis

from gateway import metrics
from shared import names


@pytest.fixture
async def client(redis_server):
    c = aioredis.Redis.from_url(redis_server.url)
    yield c
    await c.aclose()


def _unique(name: str) -> str:
    return f"{name}-{secrets.token_hex(3)}"


async def _registered(client, name: str, *versions: str) -> None:
    for version in versions:
        await client.hset(names.model_versions_key(name), version, orjson.dumps({"registered": time.time()}))


async def test_names_come_from_their_set_not_a_scan(client, monkeypatch):
    chat, gone, never = _unique("chat"), _unique("gone"), _unique("never")
    await _registered(client, chat, "v1", "v2")
    await _registered(client, gone, "v7")  # every worker of it dead: still listed
    await client.sadd(names.SERVED_NAMES, chat, gone, never)

    def no_scan(*args, **kwargs):
        raise AssertionError("a scrape walked the keyspace")
    monkeypatch.setattr(client, "scan_iter", no_scan)
    known = await metrics._known_versions(client)
    assert (known[chat], known[gone]) == (["v1", "v2"], ["v7"]) and never not in known


async def test_a_redis_from_before_the_set_is_scanned(client):
    old = _unique("old")
    await _registered(client, old, "v1")
    await client.delete(names.SERVED_NAMES)  # workers add to it again as they beat
    assert (await metrics._known_versions(client))[old] == ["v1"]


def test_a_workers_registration_and_beats_keep_its_name(redis_server):
    from shared.settings import WorkerSettings
    from worker.heartbeat import Heartbeat

    sync = redis.Redis.from_url(redis_server.url)
    name = "served-" + secrets.token_hex(3)
    settings = WorkerSettings(served_name=name, version="v1", model="m", worker_id="w-" + name)
    beat = Heartbeat(sync, settings, None, lambda: {"worker_id": settings.worker_id})
    beat.register_model()
    assert sync.sismember(names.SERVED_NAMES, name)
    sync.srem(names.SERVED_NAMES, name)  # as a Redis restarted without it would be
    beat.beat()
    assert sync.sismember(names.SERVED_NAMES, name)
    sync.close()
