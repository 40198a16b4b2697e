"""Requests queued for a route version whose workers all died move to a version that is live, so
no client waits on a stream nobody reads. Beside the dispatcher, the other writer of request
streams: it moves entries under the same depth limit, once a second in every gateway process, for
the routes that process has served (a Celery beat task would rescue only every maintenance period,
and only while Celery runs)."""
from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from gateway.routing import Router
from shared import names, protocol

log = logging.getLogger("kvgate.gateway")
SWEEP_S = 1.0
RESCUER = "kvgate-rescuer"  # consumer name the gateway reads stranded entries under
RESCUE_BATCH = 100  # entries moved per stream per sweep


class Rescuer:
    def __init__(self, redis: aioredis.Redis, router: Router, max_stream_depth: int = 1000):
        self.redis = redis
        self.router = router
        self.max_stream_depth = max_stream_depth
        self._sweeper: asyncio.Task | None = None

    async def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_forever())

    async def stop(self) -> None:
        if self._sweeper:
            self._sweeper.cancel()

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: try again next time
                log.debug("canary sweep failed: %s", type(exc).__name__)

    async def sweep(self) -> int:
        """Entries of dead route versions that no worker has read yet move to the first live
        version of their route. Entries a dead worker had already read are left for the
        crash-recovery path."""
        moved = 0
        for route in self.router.cached_routes():
            live = await self.router.live_versions(route.alias)
            target = next((v for v in route.versions() if v in live), None)
            for dead in (v for v in route.versions() if v not in live):
                if target is not None:
                    moved += await self._rescue(route.alias, dead, target)
        return moved

    async def _rescue(self, alias: str, dead: str, target: str) -> int:
        """Moves at most RESCUE_BATCH entries, and only as many as the target stream has room for
        under the depth limit, so a rescue never floods a live version. Entries this rescuer read
        but never moved (its gateway died mid-way) are taken first. Each move is one transaction
        (XADD to the target, XACK + XDEL from the source): an entry is never served twice."""
        src, dst = names.request_stream(alias, dead), names.request_stream(alias, target)
        room = min(RESCUE_BATCH, self.max_stream_depth - await self.redis.xlen(dst))
        if room <= 0:
            return 0
        try:
            entries = await self._read_stranded(src, room)
        except ResponseError:  # no group: no worker of that version ever started
            return 0
        if not entries:
            return 0
        pipe = self.redis.pipeline(transaction=True)
        for entry_id, fields in entries:
            pipe.xadd(dst, {protocol.ENTRY_FIELD: _retarget(fields.get(protocol.ENTRY_FIELD, b""), target)})
            pipe.xack(src, names.CONSUMER_GROUP, entry_id)
            pipe.xdel(src, entry_id)
        await pipe.execute()
        await self.redis.hincrby(names.canary_counters(alias), "rescued", len(entries))
        log.warning("moved %d queued request(s) of %s:%s (no live worker) to %s", len(entries),
                    alias, dead, target)
        return len(entries)

    async def _read_stranded(self, src: str, count: int) -> list:
        entries = []
        for start in ("0", ">"):  # first what this rescuer holds from an earlier, interrupted sweep
            reply = await self.redis.xreadgroup(names.CONSUMER_GROUP, RESCUER, {src: start},
                                                count=count - len(entries))
            read = reply[0][1] if reply else []
            if gone := [i for i, f in read if not f]:  # deleted since it was read: nothing to move
                await self.redis.xack(src, names.CONSUMER_GROUP, *gone)
            entries += [(i, f) for i, f in read if f]
            if len(entries) >= count:
                break
        return entries


def _retarget(raw: bytes, version: str) -> bytes:
    """The entry, now for `version`, in the schema it was written in; one this gateway cannot read
    moves as it is (the worker that gets it answers its client with an error)."""
    try:
        entry = protocol.decode_entry(raw)
    except ValueError:
        return raw
    return protocol.encode(entry.model_copy(update={"version": version}))
