"""The gateway's event-loop lag: a task sleeps a fixed interval and measures how late it woke. A
loop held by CPU work or a blocking call delays every request on it by as much, which no latency
histogram attributes to its cause."""
from __future__ import annotations

import asyncio
import time
from collections import deque

from gateway.metrics import LOOP_LAG

INTERVAL_S = 0.25
WINDOW = 20  # the gauge shows the worst of the last 5 s, so a scrape every 15 s still sees a spike


class LoopLag:
    def __init__(self, interval_s: float = INTERVAL_S):
        self.interval_s = interval_s
        self.samples: deque[float] = deque(maxlen=WINDOW)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.samples.append(max(0.0, time.perf_counter() - before - self.interval_s))
            LOOP_LAG.set(max(self.samples))
