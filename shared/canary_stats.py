"""What each version of an alias served lately: requests, errors, TTFT and TPOT, over a sliding
window kept in Redis. Gateways write one small hash per (alias, version, 5-second bucket) with a
TTL of the route's window, so the window slides by expiry and no key outlives it; the periodic
check and `kvgate canary status` read the buckets back and merge them.

Latencies are kept as histograms with bins 5% apart (0.1 ms up), so a p95 is exact to 5% and a
bucket holds at most a few hundred fields however much traffic it saw.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from shared import names

BUCKET_S = 5
FLOOR_MS = 0.1
GROWTH = 1.05


def latency_bin(ms: float) -> int:
    return 0 if ms <= FLOOR_MS else math.ceil(math.log(ms / FLOOR_MS, GROWTH))


def bin_ms(b: int) -> float:
    """The upper edge of a bin: a percentile read from the histogram errs high, never low."""
    return FLOOR_MS * GROWTH ** b


def percentile(hist: Counter, q: float) -> float | None:
    total = sum(hist.values())
    if total == 0:
        return None
    rank, seen = math.ceil(q * total), 0
    for b in sorted(hist):
        seen += hist[b]
        if seen >= rank:
            return round(bin_ms(b), 2)
    return None  # pragma: no cover


@dataclass
class WindowStats:
    """One version's requests in the window: counts and latency histograms."""

    requests: int = 0
    errors: int = 0
    ttft: Counter = field(default_factory=Counter)
    tpot: Counter = field(default_factory=Counter)

    def add(self, fields: dict[bytes, bytes]) -> None:
        for name, value in fields.items():
            kind, _, b = name.decode().partition(":")
            if kind == "n":
                self.requests += int(value)
            elif kind == "err":
                self.errors += int(value)
            elif kind in ("ttft", "tpot"):
                getattr(self, kind)[int(b)] += int(value)

    @property
    def success_rate(self) -> float | None:
        return None if self.requests == 0 else (self.requests - self.errors) / self.requests

    def summary(self) -> "VersionStats":
        return VersionStats(requests=self.requests, errors=self.errors, success_rate=self.success_rate,
                            ttft_p95_ms=percentile(self.ttft, 0.95),
                            tpot_p95_ms=percentile(self.tpot, 0.95))


class VersionStats(BaseModel):
    requests: int = Field(description="Requests that ended (served or failed) in the window")
    errors: int = Field(description="Requests that ended with a server-side error")
    success_rate: float | None = None
    ttft_p95_ms: float | None = Field(None, description="Time to first token, 95th percentile")
    tpot_p95_ms: float | None = Field(None, description="Time per output token, 95th percentile")


async def record(redis: aioredis.Redis, alias: str, version: str, window_s: int, ok: bool,
                 ttft_ms: float | None, tpot_ms: float | None, now: float | None = None) -> None:
    """One finished request; one round trip."""
    key = names.canary_window(alias, version, int((now or time.time()) // BUCKET_S))
    pipe = redis.pipeline(transaction=False)
    pipe.hincrby(key, "n", 1)
    if not ok:
        pipe.hincrby(key, "err", 1)
    if ttft_ms is not None:
        pipe.hincrby(key, f"ttft:{latency_bin(ttft_ms)}", 1)
    if tpot_ms is not None:
        pipe.hincrby(key, f"tpot:{latency_bin(tpot_ms)}", 1)
    pipe.expire(key, window_s + 2 * BUCKET_S)
    await pipe.execute()


async def read(redis: aioredis.Redis, alias: str, versions: list[str], window_s: int,
               since: float = 0.0, now: float | None = None) -> dict[str, WindowStats]:
    """Each version's stats over the last `window_s` seconds, not counting buckets wholly before
    `since` (when the canary was set: an earlier trial of the same version does not count)."""
    now = now or time.time()
    first = int(max(now - window_s, since) // BUCKET_S)
    last = int(now // BUCKET_S)
    pipe = redis.pipeline(transaction=False)
    for version in versions:
        for b in range(first, last + 1):
            pipe.hgetall(names.canary_window(alias, version, b))
    replies = iter(await pipe.execute())
    stats = {}
    for version in versions:
        stats[version] = WindowStats()
        for _ in range(first, last + 1):
            stats[version].add(next(replies))
    return stats
