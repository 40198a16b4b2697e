"""Fault injection for tests of what watches the workers (canary analysis, failover): a share of
requests answered with an engine error, and a delay before a request is admitted (so before its
first token). Off unless `kvgate worker --fault-error-rate/--fault-latency-ms` turn it on."""
from __future__ import annotations

import random
import time


class Faults:
    def __init__(self, error_rate: float = 0.0, latency_ms: float = 0.0):
        self.error_rate = error_rate
        self.latency_s = latency_ms / 1000
        self._rng = random.Random()

    def should_fail(self) -> bool:
        return self.error_rate > 0 and self._rng.random() < self.error_rate

    def delay(self) -> None:
        if self.latency_s > 0:
            time.sleep(self.latency_s)
