"""Fault injection for tests of what watches the workers (canary analysis, failover, the poison
cap): a share of requests answered with an engine error, a delay before a request is admitted (so
before its first token), a pause after every engine step, and a hard exit on a marked prompt. Off unless `kvgate worker
--fault-error-rate/--fault-latency-ms` or `KVGATE_FAULT_CRASH_MARKER` turn it on."""
from __future__ import annotations

import logging
import os
import random
import time

import orjson

log = logging.getLogger("kvgate.worker")


class Faults:
    def __init__(self, error_rate: float = 0.0, latency_ms: float = 0.0, crash_marker: str | None = None,
                 step_ms: float = 0.0):
        self.error_rate = error_rate
        self.latency_s = latency_ms / 1000
        self.step_s = step_ms / 1000
        self.crash_marker = crash_marker
        self._rng = random.Random()

    def should_fail(self) -> bool:
        return self.error_rate > 0 and self._rng.random() < self.error_rate

    def delay(self) -> None:
        if self.latency_s > 0:
            time.sleep(self.latency_s)

    def pause_step(self) -> None:
        """A slow device: every engine step takes this much longer, so a request outlives a test's
        timers (a resume grace, a sweep) on any machine, however fast."""
        if self.step_s > 0:
            time.sleep(self.step_s)

    def crash_if_marked(self, prompt: str | None, messages: list | None) -> None:
        """Exit at once, skipping every `finally` and handler: a segfault in a kernel looks like this
        to the rest of the system (the entry stays pending under a worker that is gone)."""
        if not self.crash_marker:
            return
        text = prompt if prompt is not None else orjson.dumps(messages or []).decode()
        if self.crash_marker in text:
            log.error("fault: the crash marker is in a prompt; exiting hard")
            os._exit(1)
