"""Bounded exponential back-off: retry soon after the first failure, no more often than `cap`
apart while failures go on, and soon again once something succeeded."""
from __future__ import annotations


class Backoff:
    def __init__(self, first: float, cap: float):
        self.first, self.cap = first, cap
        self.delay = first

    def next(self) -> float:
        """The wait before the next try; each call doubles the one after, up to `cap`."""
        delay, self.delay = self.delay, min(self.cap, self.delay * 2)
        return delay

    def reset(self) -> None:
        self.delay = self.first
