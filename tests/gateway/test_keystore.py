"""The key store against a real Redis: names are unique, secrets resolve by digest only."""
from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from gateway.keystore import KeyStore
from shared.errors import Conflict, NotFound


@pytest.fixture
async def store(redis_server):
    client = aioredis.Redis.from_url(redis_server.url)
    yield KeyStore(client, "server-secret")
    await client.aclose()


async def test_create_lookup_and_unique_names(store):
    import secrets

    name = "n-" + secrets.token_hex(4)
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


async def test_rotate_without_grace_drops_the_old_secret_at_once(store):
    import secrets

    record, old = await store.create(store.new_record(name="r-" + secrets.token_hex(4)))
    _, new = await store.rotate(record, grace_s=0)
    assert await store.lookup(old) is None
    assert (await store.lookup(new)).id == record.id
