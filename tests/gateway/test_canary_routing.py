"""Canary routing (and the rescue of entries queued for a dead version, gateway/rescue.py) against
a real Redis: two Router objects on two connections stand in for two gateway replicas; workers are
registry entries written the way a worker's heartbeat writes them."""
from __future__ import annotations

import asyncio
import secrets
import time
from collections import Counter

import orjson
import pytest
import redis.asyncio as aioredis

from gateway.keys import KeyRecord
from gateway.registry import Registry
from gateway.rescue import Rescuer
from gateway.routing import Router
from shared import canary, names, protocol
from shared.errors import NotFound, Overloaded, PermissionDenied


@pytest.fixture
async def replicas(redis_server):
    clients = [aioredis.Redis.from_url(redis_server.url) for _ in range(2)]
    yield [Router(c, Registry(c), stale_s=3.0) for c in clients]
    for c in clients:
        await c.aclose()


@pytest.fixture
def alias() -> str:
    return "chat-" + secrets.token_hex(4)


async def _heartbeat(client: aioredis.Redis, alias: str, version: str, ago: float = 0.0) -> str:
    """A worker of (alias, version) whose last heartbeat was `ago` seconds back."""
    worker_id = f"w-{version}-{secrets.token_hex(3)}"
    info = {"worker_id": worker_id, "served_name": alias, "version": version, "ts": time.time() - ago}
    await client.set(names.worker_key(worker_id), orjson.dumps(info), ex=30)
    await client.zadd(names.WORKERS_ZSET, {worker_id: time.time() + 30})
    await client.hset(names.model_versions_key(alias), version, b"{}")
    return worker_id


async def _put(router: Router, alias: str, **fields) -> canary.Route:
    route = canary.new_route(alias, fields.pop("stable", "v1"), fields.pop("canary", "v2"), **fields)
    stored, _ = await router.store.change(alias, lambda _: route)
    return stored


def _key(cohort: str | None = None, **fields) -> KeyRecord:
    return KeyRecord(id="key_" + secrets.token_hex(8), name="k", created=0.0, canary_cohort=cohort,
                     **fields)


async def test_ten_thousand_keys_split_ten_percent_and_stick(replicas, alias):
    a, b = replicas
    for version in ("v1", "v2"):
        await _heartbeat(a.redis, alias, version)
    await _put(a, alias, weight=10)
    keys = [_key() for _ in range(10_000)]
    first = [(await a.choose(alias, k)).version for k in keys]
    share = Counter(first)["v2"] / len(keys)
    assert 0.09 <= share <= 0.11, share
    again = [(await b.choose(alias, k)).version for k in keys[:2000]]  # another replica, later
    assert again == first[:2000]


async def test_fractional_weight_and_growing_weight_only_moves_keys_to_the_canary(replicas, alias):
    a, _ = replicas
    route = await _put(a, alias, weight=0.5)
    key_ids = [f"key_{i:06d}" for i in range(40_000)]  # enough that chance stays 4 sd inside the bounds
    at_half = {k for k in key_ids if canary.assign(route, k, None) == "v2"}
    assert 140 <= len(at_half) <= 260  # 0.5% of 40,000 = 200 (sd 14)
    wider = route.model_copy(update={"weight": 25.0})
    at_25 = {k for k in key_ids if canary.assign(wider, k, None) == "v2"}
    assert at_half < at_25 and 9500 <= len(at_25) <= 10500


async def test_cohorts_pin_versions(replicas, alias):
    a, _ = replicas
    for version in ("v1", "v2", "v3"):
        await _heartbeat(a.redis, alias, version)
    await _put(a, alias, weight=0, cohorts={"beta": "v3"})
    assert (await a.choose(alias, _key("canary"))).version == "v2"
    assert (await a.choose(alias, _key("beta"))).version == "v3"
    assert (await a.choose(alias, _key("stable"))).version == "v1"
    assert (await a.choose(alias, _key("nobody-listed"))).version == "v1"  # weight 0
    await a.store.change(alias, lambda r: canary.rolled_back(r, "test"))
    await asyncio.sleep(0.6)  # past the route cache
    assert (await a.choose(alias, _key("canary"))).version == "v1"  # a rolled-back canary: nobody


async def test_version_header_only_for_admin_and_marked_keys(replicas, alias):
    a, _ = replicas
    for version in ("v1", "v2"):
        await _heartbeat(a.redis, alias, version)
    await _put(a, alias, weight=0)
    with pytest.raises(PermissionDenied) as refused:
        await a.choose(alias, _key(), forced="v2")
    assert refused.value.code == "version_override_not_allowed"
    assert (await a.choose(alias, _key(version_override=True), forced="v2")).version == "v2"
    assert (await a.choose(alias, _key(role="admin"), forced="v2")).version == "v2"
    with pytest.raises(NotFound):
        await a.choose(alias, _key(role="admin"), forced="v9")
    await a.redis.hset(names.model_versions_key(alias), "v0", b"{}")  # known, no live worker
    with pytest.raises(Overloaded) as busy:
        await a.choose(alias, _key(role="admin"), forced="v0")
    assert busy.value.retry_after


async def test_a_route_change_reaches_the_other_replica_within_a_second(replicas, alias):
    a, b = replicas
    for version in ("v1", "v2"):
        await _heartbeat(a.redis, alias, version)
    key = _key()
    await _put(a, alias, weight=0)
    assert (await b.choose(alias, key)).version == "v1"
    await a.store.change(alias, lambda r: canary.weighted(r, 100.0))
    changed = time.monotonic()
    while (await b.choose(alias, key)).version != "v2":
        assert time.monotonic() - changed < 1.0
        await asyncio.sleep(0.05)


async def test_failover_to_stable_when_the_canary_has_no_live_worker(replicas, alias):
    a, _ = replicas
    await _heartbeat(a.redis, alias, "v1")
    await _heartbeat(a.redis, alias, "v2", ago=5.0)  # registry entry still there, heartbeat stale
    await _put(a, alias, weight=100)
    assert (await a.choose(alias, _key())).version == "v1"
    assert (await a.choose(alias, _key("canary"))).version == "v1"
    assert (await a.store.counters(alias))["failovers"] == 2
    other = "solo-" + secrets.token_hex(4)
    await _heartbeat(a.redis, other, "v1", ago=5.0)
    await a.redis.hset(names.model_versions_key(other), "v2", b"{}")
    await _put(a, other, weight=50)
    with pytest.raises(Overloaded):
        await a.choose(other, _key())


async def _queued_for_dead_v2(a: Router, alias: str, schema: int = protocol.SCHEMA_VERSION) -> str:
    """v1 live and on the route; three entries queued for v2, which has no live worker."""
    await _heartbeat(a.redis, alias, "v1")
    await _put(a, alias, weight=100)
    dead = names.request_stream(alias, "v2")
    await a.redis.xgroup_create(dead, names.CONSUMER_GROUP, id="0", mkstream=True)
    for i in range(3):
        entry = protocol.RequestEntry(request_id=f"r{i}", reply_channel="c", model=alias,
                                      version="v2", kind="completion", prompt="hi", created=0.0,
                                      deadline=time.time() + 60)
        await a.redis.xadd(dead, {protocol.ENTRY_FIELD: protocol.encode(entry, version=schema)})
    return dead


async def test_requests_queued_for_a_dead_version_move_to_a_live_one(replicas, alias):
    a, _ = replicas
    rescuer = Rescuer(a.redis, a)
    dead = await _queued_for_dead_v2(a, alias)
    await a.route_of(alias)  # the sweep looks at routes this process has served
    assert await rescuer.sweep() == 3
    moved = await a.redis.xrange(names.request_stream(alias, "v1"))
    entries = [protocol.decode_entry(f[protocol.ENTRY_FIELD]) for _, f in moved]
    assert [(e.request_id, e.version) for e in entries] == [("r0", "v1"), ("r1", "v1"), ("r2", "v1")]
    assert await a.redis.xlen(dead) == 0
    assert (await a.store.counters(alias))["rescued"] == 3


async def test_a_rescue_respects_the_target_depth_keeps_the_schema_and_resumes_its_own_reads(replicas, alias):
    a, _ = replicas
    rescuer = Rescuer(a.redis, a, max_stream_depth=2)
    dead = await _queued_for_dead_v2(a, alias, schema=1)
    # an earlier sweep of this gateway read one entry and died before moving it
    await a.redis.xreadgroup(names.CONSUMER_GROUP, "kvgate-rescuer", {dead: ">"}, count=1)
    await a.route_of(alias)
    assert await rescuer.sweep() == 2  # the live stream has room for two
    moved = await a.redis.xrange(names.request_stream(alias, "v1"))
    raws = [orjson.loads(f[protocol.ENTRY_FIELD]) for _, f in moved]
    assert [(r["request_id"], r["version"], r["v"]) for r in raws] == [("r0", "v1", 1), ("r1", "v1", 1)]
    assert await rescuer.sweep() == 0 and await a.redis.xlen(dead) == 1  # full: the last one waits


async def test_made_up_model_names_never_grow_the_route_cache(replicas):
    from gateway.routing import ROUTE_CACHE_SIZE

    a, _ = replicas
    for _ in range(ROUTE_CACHE_SIZE + 200):
        assert await a.route_of("made-up-" + secrets.token_hex(8)) is None
    assert len(a._routeless) == ROUTE_CACHE_SIZE and not a._routes


async def test_an_odd_registry_entry_is_skipped_not_fatal(replicas, alias):
    a, _ = replicas
    for worker_id, raw in (("odd-empty", b"{}"), ("odd-text", b"not json"), ("odd-list", b"[1]")):
        await a.redis.set(names.worker_key(worker_id), raw, ex=30)
        await a.redis.zadd(names.WORKERS_ZSET, {worker_id: time.time() + 30})
    await _heartbeat(a.redis, alias, "v1")
    assert (await a.choose(alias, _key())).version == "v1"
    assert all(isinstance(w["served_name"], str) for w in await a.registry.live_workers())
    for worker_id in ("odd-empty", "odd-text", "odd-list"):
        await a.redis.zrem(names.WORKERS_ZSET, worker_id)
