"""The event-loop lag gauge (gateway/loop_lag.py): a loop blocked for 0.3 s reads about 0.3 s late."""
from __future__ import annotations

import asyncio
import time

from gateway.loop_lag import LoopLag
from gateway.metrics import LOOP_LAG


async def test_a_blocked_loop_shows_as_lag_and_a_free_one_does_not():
    lag = LoopLag(interval_s=0.05)
    lag.start()
    try:
        await asyncio.sleep(0.2)
        assert max(lag.samples) < 0.1  # a free loop (2 busy cores: generous)
        time.sleep(0.3)  # a blocking call on the loop
        await asyncio.sleep(0.1)
        assert max(lag.samples) >= 0.25
        assert LOOP_LAG._value.get() >= 0.25
    finally:
        lag.stop()
