"""The stored responses' size quota on a real Redis: the total follows stores, re-stores, deletes and
expiries exactly; a check never reads the key's whole hash once it is counted (summing it on every
request held Redis 0.33 s for a key of 330,000 responses); a hash written before the total existed
is counted once; every key of the quota has a TTL."""
from __future__ import annotations

import asyncio
import secrets
import time

import orjson

from gateway.responses_store import DROP, ResponseStore
from shared import names


def _response(rid: str, text: str = "hi") -> dict:
    return {"id": rid, "object": "response", "output_text": text}


def _size(rid: str, text: str = "hi", conversation: list | None = None) -> int:
    return len(orjson.dumps({"response": _response(rid, text), "conversation": conversation or []}))


async def _hgetall_calls(aredis) -> int:
    return int((await aredis.info("commandstats")).get("cmdstat_hgetall", {}).get("calls", 0))


async def test_the_total_follows_stores_restores_and_deletes(aredis):
    store, key = ResponseStore(aredis, 3600), "key_" + secrets.token_hex(4)
    assert await store.used(key) == 0
    await store.put(key, _response("resp_a"), [])
    await store.put(key, _response("resp_b", "longer text"), [])
    assert await store.used(key) == _size("resp_a") + _size("resp_b", "longer text")
    await store.put(key, _response("resp_a", "again, longer"), [])  # the same id: its new size only
    assert await store.used(key) == _size("resp_a", "again, longer") + _size("resp_b", "longer text")
    assert await store.delete(key, "resp_b") and not await store.delete(key, "resp_b")
    assert await store.used(key) == _size("resp_a", "again, longer")
    assert (await store.get(key, "resp_a"))["response"]["output_text"] == "again, longer"
    for name in (names.stored_responses(key), names.stored_response_expiries(key),
                 names.stored_response_bytes(key), names.stored_response(key, "resp_a")):
        assert 0 < await aredis.ttl(name) <= 3600, name


async def test_expired_responses_leave_the_total_a_bounded_number_at_a_time(aredis):
    store, key = ResponseStore(aredis, 3), "key_" + secrets.token_hex(4)
    quota = [names.stored_responses(key), names.stored_response_expiries(key), names.stored_response_bytes(key)]
    await store.put(key, _response("resp_kept"), [])
    expired = int(time.time()) - 10  # as if stored long ago: more than one check can drop
    for name in quota:
        await aredis.persist(name)
    async with aredis.pipeline(transaction=False) as pipe:
        for i in range(DROP + 5):
            pipe.hset(quota[0], f"resp_{i}", f"100:{expired}")
            pipe.zadd(quota[1], {f"resp_{i}": expired})
        pipe.incrby(quota[2], 100 * (DROP + 5))
        await pipe.execute()
    kept = _size("resp_kept")
    assert await store.used(key) == kept + 500  # DROP of them dropped, 5 left for the next check
    assert await store.used(key) == kept
    await asyncio.sleep(3.2)  # resp_kept's own expiry (retention 3 s) has passed
    assert await store.used(key) == 0 and await aredis.hlen(quota[0]) == 0


async def test_a_check_does_not_read_the_whole_hash_once_it_is_counted(aredis):
    store, key = ResponseStore(aredis, 3600), "key_" + secrets.token_hex(4)
    expiry = int(time.time()) + 3600
    async with aredis.pipeline(transaction=False) as pipe:  # as a gateway before the total wrote it
        for i in range(2000):
            pipe.hset(names.stored_responses(key), f"resp_{i}", f"300:{expiry}")
        pipe.hset(names.stored_responses(key), "resp_old", f"300:{int(time.time()) - 1}")
        await pipe.execute()
    before = await _hgetall_calls(aredis)
    assert await store.used(key) == 300 * 2000  # counted once, in full (the expired one dropped)
    await store.put(key, _response("resp_new"), [])
    for _ in range(20):
        assert await store.used(key) == 300 * 2000 + _size("resp_new")
    assert await _hgetall_calls(aredis) == before + 1
