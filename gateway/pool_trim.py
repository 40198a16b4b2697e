"""Closes the Redis connections a burst opened once they sit idle (`KVGATE_REDIS_IDLE_TIMEOUT_S`),
so a gateway's pool follows its load down as well as up, and shows the pool's size on /metrics."""
from __future__ import annotations

import asyncio
import logging

from gateway.metrics import REDIS_CONNECTIONS
from shared.redis_client import IdleClosingPool

log = logging.getLogger("kvgate.gateway")


class PoolTrim:
    def __init__(self, pool: object, idle_s: float):
        # only the one-Redis pool is ours to trim: a cluster's or sentinel's pools are redis-py's
        self.pool = pool if isinstance(pool, IdleClosingPool) else None
        self.idle_s = idle_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.pool is not None:
            self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        every = min(max(self.idle_s / 2, 0.5), 10.0)
        while True:
            await asyncio.sleep(every)
            if self.idle_s > 0:
                try:
                    if closed := await self.pool.close_idle(self.idle_s):
                        log.debug("closed %d idle Redis connections", closed)
                except Exception as exc:  # a socket that fails to close is closed anyway
                    log.warning("closing idle Redis connections failed: %s", exc)
            idle, in_use = self.pool.counts()
            REDIS_CONNECTIONS.labels("idle").set(idle)
            REDIS_CONNECTIONS.labels("in_use").set(in_use)
