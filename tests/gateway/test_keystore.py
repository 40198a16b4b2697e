"""The key store against a real Redis: names are unique, secrets resolve by digest only, and every
write is atomic against every other (many writers at once, one Redis)."""
from __future__ import annotations

import asyncio
import secrets

import pytest
import redis.asyncio as aioredis

from gateway.keystore import KeyStore
from shared import names
from shared.errors import Conflict, NotFound


@pytest.fixture
async def store(redis_server):
    client = aioredis.Redis.from_url(redis_server.url, max_connections=200)
    yield KeyStore(client, "server-secret")
    await client.aclose()


def _name(prefix: str = "n") -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


async def test_create_lookup_and_unique_names(store):
    name = _name()
    record, secret = await store.create(store.new_record(name=name, rpm=5))
    assert (await store.lookup(secret)).id == record.id
    assert await store.lookup(secret + "x") is None
    assert (await store.get(name)).rpm == 5 and (await store.get(record.id)).name == name
    with pytest.raises(Conflict):
        await store.create(store.new_record(name=name))
    other = KeyStore(store.redis, "another-server-secret")
    assert await other.lookup(secret) is None  # the digest is keyed by the server secret


async def test_unknown_names_are_404(store):
    with pytest.raises(NotFound, match="No API key named 'ghost'"):
        await store.get("ghost")
    with pytest.raises(NotFound):
        await store.revoke("key_ghost")


async def test_rotate_without_grace_drops_the_old_secret_at_once(store):
    record, old = await store.create(store.new_record(name=_name("r")))
    _, new = await store.rotate(record.id, grace_s=0)
    assert await store.lookup(old) is None
    assert (await store.lookup(new)).id == record.id


async def test_update_racing_revoke_never_reactivates(store):
    records = [(await store.create(store.new_record(name=_name("p"))))[0] for _ in range(30)]

    def patch(r):
        return r.model_copy(update={"rpm": 7, "metadata": {"patched": "yes"}})

    await asyncio.gather(*(op for r in records
                           for op in (store.update(r.id, patch), store.revoke(r.id))))
    for r in records:
        now = await store.get(r.id)
        assert now.status == "revoked" and now.revoked is not None
        assert now.rpm == 7  # both writes landed: neither undid the other


async def test_concurrent_rotations_leave_one_current_secret(store):
    record, first = await store.create(store.new_record(name=_name("rot")))
    results = await asyncio.gather(*(store.rotate(record.id, grace_s=30) for _ in range(20)))
    current = (await store.redis.hget(names.key_record(record.id), "digest")).decode()
    digests = [store.digest(s) for s in [first] + [secret for _, secret in results]]
    ttls = {d: await store.redis.ttl(names.key_digest(d)) for d in digests}
    assert ttls[current] == -1  # the current digest: no TTL
    assert [d for d, ttl in ttls.items() if ttl == -1] == [current]
    assert all(0 < ttl <= 30 for d, ttl in ttls.items() if d != current)


async def test_concurrent_rotations_without_grace_leave_only_the_current_secret(store):
    record, first = await store.create(store.new_record(name=_name("rot0")))
    results = await asyncio.gather(*(store.rotate(record.id, grace_s=0) for _ in range(20)))
    working = [s for s in [first] + [secret for _, secret in results] if await store.lookup(s)]
    assert len(working) == 1
    current = (await store.redis.hget(names.key_record(record.id), "digest")).decode()
    assert store.digest(working[0]) == current


async def test_concurrent_renames_to_one_name_leave_it_unique(store):
    records = [(await store.create(store.new_record(name=_name("ren"))))[0] for _ in range(10)]
    target = _name("taken")

    async def rename(r):
        try:
            return await store.update(r.id, lambda rec: rec.model_copy(update={"name": target}))
        except Conflict:
            return None

    renamed = [r for r in await asyncio.gather(*(rename(r) for r in records)) if r is not None]
    assert len(renamed) == 1
    assert (await store.get(target)).id == renamed[0].id
    index = {k.decode(): v.decode() for k, v in (await store.redis.hgetall(names.KEY_NAMES)).items()}
    for r in records:  # every key is indexed under exactly its current name
        now = await store.get(r.id)
        assert index[now.name] == r.id and list(index.values()).count(r.id) == 1


async def test_a_record_stored_before_cache_scope_reads_its_isolation(store):
    for isolated, scope in ((True, "key"), (False, "tenant")):
        record, secret = await store.create(store.new_record(name=_name("old")))
        legacy = record.model_dump(exclude={"cache_scope", "best_priority"})
        legacy["cache_isolation"] = isolated
        import json

        await store.redis.hset(names.key_record(record.id), "record", json.dumps(legacy))
        assert (await store.lookup(secret)).cache_scope == scope
        rewritten = await store.update(record.id, lambda r: r.model_copy(update={"rpm": 3}))
        raw = await store.redis.hget(names.key_record(record.id), "record")
        assert rewritten.cache_scope == scope and b"cache_isolation" not in raw


# -- the records a gateway keeps (KVGATE_KEY_CACHE_S) ------------------------------------------
async def _listening(redis_url: str, cache_s: float):
    """A gateway's key store with its dispatcher's subscription, as gateway/state.py wires them."""
    from gateway.dispatch import Dispatcher

    client = aioredis.Redis.from_url(redis_url)
    dispatcher = Dispatcher(client, f"gw-{secrets.token_hex(3)}")
    store = KeyStore(client, "server-secret", cache_s, live=dispatcher.subscribed.is_set)
    dispatcher.listen_also(names.KEYS_CHANGED_CHANNEL, store.on_changed, store.forget)
    await dispatcher.start()
    return store, dispatcher


async def _eventually(check, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        assert loop.time() < deadline, "not within the timeout"
        await asyncio.sleep(0.02)


async def test_a_kept_record_is_dropped_on_every_gateway_when_its_key_changes(redis_server):
    a, a_sub = await _listening(redis_server.url, cache_s=60)  # only a change could end a copy
    b, b_sub = await _listening(redis_server.url, cache_s=60)
    try:
        record, secret = await a.create(a.new_record(name=_name(), rpm=5))
        assert (await a.lookup(secret)).rpm == 5 and (await b.lookup(secret)).rpm == 5
        # kept: a write behind the store's back (none of ours does this) is not seen ...
        stale = record.model_copy(update={"rpm": 99}).model_dump_json()
        await a.redis.hset(names.key_record(record.id), "record", stale)
        assert (await a.lookup(secret)).rpm == 5
        # ... a revoke through one gateway is, at once there and as its message lands on the other
        await b.revoke(record.id)
        assert (await b.lookup(secret)).status == "revoked"

        async def a_sees_it() -> bool:
            return (await a.lookup(secret)).status == "revoked"
        await _eventually(a_sees_it)
        # an unknown secret is never kept: a key made after a miss works at once
        assert await a.lookup("sk-not-yet") is None
    finally:
        await a_sub.stop()
        await b_sub.stop()


async def test_nothing_is_kept_while_changes_cannot_arrive(store):
    record, secret = await store.create(store.new_record(name=_name()))
    offline = KeyStore(store.redis, "server-secret", cache_s=60)  # no subscription: live() is False
    assert (await offline.lookup(secret)).status == "active"
    await store.redis.hset(names.key_record(record.id), "record",
                           record.model_copy(update={"status": "revoked"}).model_dump_json())
    assert (await offline.lookup(secret)).status == "revoked"  # read again, not kept


async def test_a_rotated_out_secret_is_kept_no_longer_than_its_grace(redis_server):
    store, sub = await _listening(redis_server.url, cache_s=60)
    try:
        record, old = await store.create(store.new_record(name=_name()))
        await store.rotate(record.id, grace_s=1)
        assert await store.lookup(old) is not None  # within its grace, and now kept
        await asyncio.sleep(1.3)
        assert await store.lookup(old) is None  # the copy lived no longer than the digest
    finally:
        await sub.stop()
