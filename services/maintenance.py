"""Periodic maintenance, run by Celery beat every KVGATE_MAINTENANCE_S (tests call these directly):

- `reap_workers`: drop registry members whose heartbeat lapsed (each heartbeat trims the set too,
  but only while some worker lives), and the consumers that dead workers left in the request
  streams' groups (worker ids are new per process, so they would pile up), once nothing is
  pending on them: what is pending stays for takeover to claim.
- expiring files: `FileStore.expire` deletes files past their expiry, bytes, record and quota
  entry (and partial files of uploads a dead gateway left behind).
- `tend_batches`: start a runner for every active batch that none holds: new ones whose task
  message was lost, ones waiting for a free slot, and ones whose runner died (they resume); an id
  whose batch is gone or final leaves the active set. No more messages are sent while as many
  still wait in the queue (a stopped Celery worker must not make the queue grow every period).

- folding usage: `fold` (shared/usage.py) rolls each day that is over into one hash, so
  a usage report over many days and keys reads one hash per day.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import redis.asyncio as aioredis

from shared import names
from shared.batches import BATCH_QUEUE, BatchStore


async def reap_workers(redis: aioredis.Redis) -> dict[str, int]:
    now = time.time()
    members = await redis.zremrangebyscore(names.WORKERS_ZSET, "-inf", now)
    consumers = 0
    async for stream in redis.scan_iter(match=names.request_stream("*", "*", "*"), _type="stream"):
        try:
            found = await redis.xinfo_consumers(stream, names.CONSUMER_GROUP)
        except aioredis.ResponseError:  # no group on this stream
            continue
        for consumer in found:
            name = consumer["name"].decode() if isinstance(consumer["name"], bytes) else consumer["name"]
            if consumer["pending"] == 0 and not await redis.exists(names.worker_key(name)):
                await redis.xgroup_delconsumer(stream, names.CONSUMER_GROUP, name)
                consumers += 1
    return {"registry_members": members, "consumers": consumers}


async def tend_batches(redis: aioredis.Redis, start: Callable[[str], None]) -> list[str]:
    """Start a runner for each active batch without one; the ids started."""
    store = BatchStore(redis)
    running = await store.running()
    idle = [b for b in await store.active() if b not in running and await store.runnable(b)]
    if await redis.llen(names.celery_queue(BATCH_QUEUE)) >= len(idle):
        return []  # each could already have a message waiting: a runner will come
    for batch_id in idle:
        start(batch_id)
    return idle
