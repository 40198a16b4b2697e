"""A usage report's span: never longer than the retention, whatever `since` it is given."""
from __future__ import annotations

import secrets
import time

import redis.asyncio as aioredis

from shared.usage import UsageBook


async def test_an_absurd_since_reads_only_the_retained_days(redis_server):
    client = aioredis.Redis.from_url(redis_server.url)
    book = UsageBook(client, retention_days=3)
    key_id = "key_" + secrets.token_hex(4)
    now = time.time()
    await book.record(key_id, "demo", "v1", {"prompt_tokens": 3, "completion_tokens": 4})
    assert book.window_start(0.0, now=now) == now - 3 * 86400
    assert book.window_start(now - 60, now=now) == now - 60
    started = time.monotonic()
    rows = await book.query(-1e15, key_id, "day")  # far before 1970: clamped, not looped
    assert time.monotonic() - started < 2
    assert 1 <= len(rows) <= 4 and sum(r["total_tokens"] for r in rows) == 7
    await client.aclose()
