"""Stored-data quotas on a real Redis: exact under concurrency, nothing counted twice or left
behind (a file deleted twice, a batch ended twice, a hold whose process died)."""
from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from shared import names
from shared.batches import BatchStore
from shared.errors import QuotaExceeded
from shared.files import FileStore
from shared.quota import Quota, QuotaLimits


@pytest.fixture
async def client(redis_server):
    c = aioredis.Redis.from_url(redis_server.url)
    yield c
    await c.aclose()


def owner() -> str:
    import secrets

    return "key_" + secrets.token_hex(4)


async def test_concurrent_holds_never_pass_the_limit(client):
    quota, who = Quota(client), owner()
    limits = QuotaLimits("alice", bytes=1000, files=100)

    async def one(i: int) -> bool:
        try:
            await quota.hold_upload(who, f"t{i}", 300, time.time() + 60, limits)
            return True
        except QuotaExceeded as exc:
            assert "stored bytes (max_stored_bytes): Limit 1000" in exc.message
            assert exc.status == 429 and exc.type == "insufficient_quota"
            return False

    granted = await asyncio.gather(*(one(i) for i in range(40)))
    assert sum(granted) == 3
    assert (await quota.usage(who)).bytes == 900


async def test_a_hold_grows_and_shrinks_in_place_and_an_expired_one_counts_no_more(client):
    quota, who = Quota(client), owner()
    limits = QuotaLimits("bob", bytes=1000, files=2)
    await quota.hold_upload(who, "a", 100, time.time() + 60, limits)
    await quota.hold_upload(who, "a", 900, time.time() + 60, limits)  # its own 100 is not counted twice
    with pytest.raises(QuotaExceeded, match="Limit 1000, Used 900, Requested 200"):
        await quota.hold_upload(who, "b", 200, time.time() + 60, limits)
    await quota.hold_upload(who, "a", 50, time.time() - 1, limits)  # as if its gateway died
    await quota.hold_upload(who, "b", 1000, time.time() + 60, limits)
    assert (await quota.usage(who)).bytes == 1000
    assert await client.hexists(names.stored_by(who), "u:a") == 0  # the dead one was dropped


async def test_files_count_until_deleted_or_expired_and_twice_is_once(client, tmp_path):
    files, who = FileStore(client, tmp_path, 3600), owner()
    limits = QuotaLimits("carol", bytes=10_000, files=2)
    a = await files.create(who, "a.jsonl", "batch", b"x" * 400)
    b = await files.create(who, "b.jsonl", "batch", b"y" * 500)
    assert (await files.quota.usage(who)).bytes == 900
    with pytest.raises(QuotaExceeded, match=r"on files \(max_files\): Limit 2, Used 2, Requested 1"):
        await files.quota.hold_upload(who, "c", 1, time.time() + 60, limits)
    await asyncio.gather(files.delete(a), files.delete(a))  # two deletes race: one file goes
    assert (await files.quota.usage(who)).bytes == 500
    await files.quota.hold_upload(who, "c", 1, time.time() + 60, limits)  # a file's room again
    await files.quota.release(who, "u:c")
    await files.expire(now=b.expires_at + 1)
    assert await client.exists(names.stored_by(who)) == 0  # nothing left: the key is gone


async def test_batches_in_progress_count_until_final(client, tmp_path):
    store, who = BatchStore(client), owner()
    limits = QuotaLimits("dave", bytes=10, files=10, batches=2)
    first = await store.create(who, "/v1/completions", "file-x", "24h", None, limits)
    await store.create(who, "/v1/completions", "file-x", "24h", None, limits)
    with pytest.raises(QuotaExceeded, match=r"batches in progress \(max_batches_in_progress\): "
                                            r"Limit 2, Used 2"):
        await store.create(who, "/v1/completions", "file-x", "24h", None, limits)
    assert await store.finish(first, "cancelled", "validating")
    assert not await store.finish(first, "cancelled", "validating")  # once only
    await store.create(who, "/v1/completions", "file-x", "24h", None, limits)
    assert (await store.quota.usage(who)).batches == 2
    assert 0 < await client.ttl(names.batches_of(who))  # the index goes after its records


async def test_a_batch_needs_room_for_its_results(client, tmp_path):
    files, store, who = FileStore(client, tmp_path, 3600), BatchStore(client), owner()
    await files.create(who, "in.jsonl", "batch", b"z" * 10)
    with pytest.raises(QuotaExceeded, match="stored bytes.*room for its output files"):
        await store.create(who, "/v1/completions", "file-x", "24h", None,
                           QuotaLimits("erin", bytes=10, files=10, batches=5))
    with pytest.raises(QuotaExceeded, match="on files"):
        await store.create(who, "/v1/completions", "file-x", "24h", None,
                           QuotaLimits("erin", bytes=100, files=2, batches=5))
    assert (await store.quota.usage(who)).batches == 0  # a refused batch holds nothing


async def test_the_active_set_forgets_batches_that_are_gone_or_final(client):
    store, who = BatchStore(client), owner()
    batch = await store.create(who, "/v1/completions", "file-x", "24h", None)
    await store.move(batch.id, "cancelled", "validating")  # as if its runner died right here
    await client.sadd(names.BATCHES_ACTIVE, "batch_gone")
    assert await store.runnable(batch.id) is None and await store.runnable("batch_gone") is None
    assert not {batch.id, "batch_gone"} & set(await store.active())
    assert (await store.quota.usage(who)).batches == 0
    assert 0 < await client.ttl(names.batch_record(batch.id))


async def test_maintenance_drops_the_holds_of_keys_that_check_no_more(client):
    quota, who = Quota(client), owner()
    soon = time.time() + 2  # then their gateway died: nothing renews or releases them
    await quota.hold_upload(who, "dead", 10, soon, None)
    await quota.hold_batch(who, "batch_dead", soon, None)
    await quota.hold_upload(who, "live", 10, time.time() + 60, None)
    assert await quota.prune(now=soon + 1) >= 2
    assert set(await client.hkeys(names.stored_by(who))) == {b"u:live"}
