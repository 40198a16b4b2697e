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
