"""A key's batches and files listed a page at a time on a real Redis: pages follow one another by
rank from `after`, none twice; an id whose record expired is passed over; and no page reads the
key's whole list (batches: every one of the last 32 days, which no quota bounds; files: up to
100,000)."""
from __future__ import annotations

import secrets

import pytest
import redis.asyncio as aioredis

from shared import names
from shared.batches import BatchStore


@pytest.fixture
async def client(redis_server):
    c = aioredis.Redis.from_url(redis_server.url)
    yield c
    await c.aclose()


async def _made(store: BatchStore, who: str, n: int) -> list[str]:
    made = [(await store.create(who, "/v1/chat/completions", "file-x", "24h", None)).id for _ in range(n)]
    listed = await store.redis.zrange(names.batches_of(who), 0, -1, desc=True)
    assert sorted(made) == sorted(i.decode() for i in listed)
    return [i.decode() for i in listed]  # newest first, as the list orders them


async def test_pages_follow_one_another_newest_first(client):
    store, who = BatchStore(client), "key_" + secrets.token_hex(4)
    newest_first = await _made(store, who, 25)
    seen, after, pages = [], None, 0
    while True:
        page, more = await store.list(who, after, limit=10)
        seen += [b.id for b in page]
        pages += 1
        if not more:
            break
        after = page[-1].id
    assert seen == newest_first and pages == 3
    assert [b.id for b in (await store.list(who, "batch_not_there", limit=5))[0]] == newest_first[:5]


async def test_an_expired_record_is_passed_over_and_the_page_still_full(client):
    store, who = BatchStore(client), "key_" + secrets.token_hex(4)
    newest_first = await _made(store, who, 8)
    for gone in (newest_first[1], newest_first[2]):
        await client.delete(names.batch_record(gone))
    page, more = await store.list(who, limit=5)
    assert [b.id for b in page] == [newest_first[i] for i in (0, 3, 4, 5, 6)] and more


async def test_no_page_reads_the_whole_list(client, monkeypatch):
    store, who = BatchStore(client), "key_" + secrets.token_hex(4)
    newest_first = await _made(store, who, 30)
    spans = []
    real = client.zrange

    async def zrange(name, start, end, *args, **kwargs):
        spans.append((start, end))
        return await real(name, start, end, *args, **kwargs)
    monkeypatch.setattr(client, "zrange", zrange)
    page, _ = await store.list(who, newest_first[9], limit=4)
    assert [b.id for b in page] == newest_first[10:14]
    assert spans and all(0 <= start <= end and end - start <= 4 for start, end in spans)


async def test_files_list_by_rank_with_and_without_a_purpose(client, tmp_path, monkeypatch):
    from shared import files
    from shared.files import FileStore, StoredFile

    monkeypatch.setattr(files, "LIST_SCAN", 3)
    store, who = FileStore(client, tmp_path, 3600), "key_" + secrets.token_hex(4)
    ids = []
    for i in range(12):  # every third one a batch file
        record = StoredFile(id=f"file-{i:02d}", bytes=1, created_at=1000 + i, filename="f",
                            purpose="batch" if i % 3 == 0 else "batch_output", owner=who)
        await client.set(names.file_record(record.id), record.model_dump_json())
        await client.zadd(names.files_of(who), {record.id: 1000 + i})
        ids.append(record.id)
    spans = []
    real = client.zrange

    async def zrange(name, start, end, *args, **kwargs):
        spans.append(end - start)
        return await real(name, start, end, *args, **kwargs)
    monkeypatch.setattr(client, "zrange", zrange)
    page, more = await store.list(who, limit=4)
    assert [f.id for f in page] == ids[::-1][:4] and more
    page, more = await store.list(who, order="asc", after=ids[5], limit=4)
    assert [f.id for f in page] == ids[6:10] and more
    page, more = await store.list(who, purpose="batch", limit=2)
    assert [f.id for f in page] == ["file-09", "file-06"] and more
    page, more = await store.list(who, purpose="batch", after="file-06", limit=2)
    assert [f.id for f in page] == ["file-03", "file-00"] and not more
    assert max(spans) < 5  # never the whole list (12) at once
