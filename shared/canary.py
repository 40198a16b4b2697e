"""Canary routes: which version of a served name (an alias) each caller gets, and how that changes
(staged steps, promotion, rollback). One JSON record per alias in Redis, read by every gateway and
written by the admin API and the periodic check, always by compare-and-set so neither undoes the
other's change.

Assignment is sticky: (key id, alias) hashes into one of 10,000 buckets, and the first
`weight × 100` buckets go to the canary, so a key stays on its version while the weight holds and
moves at most once (stable → canary) as the weight grows.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Literal

import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from shared import names
from shared.redis_client import is_cluster

BUCKETS = 10_000
MAX_EVENTS = 100  # events kept per alias
CAS_RETRIES = 20
# bounds of what an admin may set: Thresholds carries its own; steps, interval and cohorts are
# bounded where they are set (gateway/canary_schemas.py), so a stored Route still reads as written
MAX_RATIO = 1000.0
MAX_SAMPLES = 1_000_000
MAX_STEPS = 20
MAX_INTERVAL_S = 30 * 86400
MAX_COHORTS = 64
Phase = Literal["canary", "rolled_back", "promoted"]
BUILTIN_COHORTS = ("canary", "stable")  # a key's cohort may name a role instead of a version

STALE, SWAPPED = 0, 1  # what CAS answers: someone wrote since the read, or the new JSON is stored
# KEYS: route, alias index (absent on a cluster: added before, in its own slot). ARGV: the JSON
# read before ('' if none), the new JSON, the alias.
CAS = """
local current = redis.call('GET', KEYS[1]) or ''
if current ~= ARGV[1] then return %(stale)d end
redis.call('SET', KEYS[1], ARGV[2])
if KEYS[2] then redis.call('SADD', KEYS[2], ARGV[3]) end
return %(swapped)d
""" % {"stale": STALE, "swapped": SWAPPED}


class Thresholds(BaseModel):
    """When the canary fails its analysis (compared with stable over the window)."""

    min_success_rate: float = Field(0.99, ge=0, le=1, description="Below this share of successful "
                                    "requests the canary fails")
    max_ttft_ratio: float = Field(1.5, gt=0, le=MAX_RATIO, description="Canary TTFT p95 above "
                                  "this many times stable's fails")
    max_tpot_ratio: float | None = Field(None, gt=0, le=MAX_RATIO, description="Canary TPOT p95 "
                                         "above this many times stable's fails; null: not checked")
    min_samples: int = Field(50, ge=1, le=MAX_SAMPLES, description="Requests the canary (and, "
                             "for the latency ratios, stable) must have served in the window "
                             "before it is judged")
    window_s: int = Field(120, ge=5, le=86400, description="Sliding analysis window, seconds")


class Route(BaseModel):
    alias: str = Field(description="The served name clients ask for")
    stable: str = Field(description="The version everyone gets unless routed to the canary")
    canary: str | None = Field(None, description="The version on trial; null after a promotion")
    weight: float = Field(0.0, ge=0, le=100, description="Percent of keys routed to the canary")
    steps: list[float] = Field(default_factory=list, description="Weights to advance through, "
                               "one per interval, while the analysis passes; 100 promotes")
    interval_s: int | None = Field(None, ge=1, description="Seconds between steps")
    paused: bool = Field(False, description="Steps do not advance (rollback still acts)")
    cohorts: dict[str, str] = Field(default_factory=dict, description="Cohort -> version: keys "
                                    "whose canary_cohort is listed get that version")
    thresholds: Thresholds = Field(default_factory=Thresholds)
    phase: Phase = Field("canary", description="canary: on trial; rolled_back: pulled (weight 0); "
                         "promoted: the canary became stable")
    reason: str | None = Field(None, description="Why the last rollback happened")
    started: float = Field(description="Unix time the canary was set; analysis counts from here")
    step_started: float = Field(description="Unix time the weight last changed")
    updated: float = Field(description="Unix time of the last change")

    @property
    def on_trial(self) -> bool:
        return self.canary is not None and self.phase == "canary"

    def cohort_version(self, cohort: str | None) -> str | None:
        """The version a cohort is pinned to: listed in `cohorts`, or the role it names."""
        if cohort is None:
            return None
        if cohort in self.cohorts:
            return self.cohorts[cohort]
        if cohort == "canary":
            return self.canary if self.on_trial else self.stable
        if cohort == "stable":
            return self.stable
        return None

    def versions(self) -> list[str]:
        return [v for v in (self.stable, self.canary) if v is not None]


class Event(BaseModel):
    ts: float
    kind: str = Field(description="set, advance, promote, rollback, pause, resume")
    message: str
    stable: str
    canary: str | None
    weight: float


def bucket(key_id: str, alias: str) -> int:
    """A key's bucket for an alias, in [0, 10000): the same in every process, forever."""
    digest = hashlib.sha256(f"{key_id}\x00{alias}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


def assign(route: Route, key_id: str, cohort: str | None) -> str:
    """The version a key gets before liveness is considered: its cohort's pin, else its bucket."""
    pinned = route.cohort_version(cohort)
    if pinned is not None:
        return pinned
    if route.on_trial and bucket(key_id, route.alias) < round(route.weight * BUCKETS / 100):
        return route.canary
    return route.stable


class RouteStore:
    """Routes, their events and counters in Redis."""

    def __init__(self, redis: aioredis.Redis):
        self.redis = redis
        self._cas = redis.register_script(CAS)

    async def get(self, alias: str) -> Route | None:
        raw = await self.redis.get(names.canary_route(alias))
        return Route.model_validate_json(raw) if raw else None

    async def aliases(self) -> list[str]:
        return sorted(a.decode() for a in await self.redis.smembers(names.CANARY_ROUTES))

    async def change(self, alias: str,
                     edit: Callable[[Route | None], Route | None]) -> tuple[Route | None, bool]:
        """Apply `edit` to the current route and store the result if nobody wrote in between (else
        read again and retry): (the route now, whether it changed). `edit` returning None leaves
        the route as it is."""
        for _ in range(CAS_RETRIES):
            raw = await self.redis.get(names.canary_route(alias))
            current = Route.model_validate_json(raw) if raw else None
            new = edit(current)
            if new is None:
                return current, False
            new = new.model_copy(update={"updated": time.time()})
            keys = [names.canary_route(alias), names.CANARY_ROUTES]
            if is_cluster(self.redis):  # two slots: the alias listed first (readers skip one
                await self.redis.sadd(keys.pop(), alias)  # without a route), then the CAS alone
            if await self._cas(keys=keys, args=[raw or b"", new.model_dump_json(), alias]) == SWAPPED:
                return new, True
        raise RuntimeError(f"route of '{alias}' kept changing under {CAS_RETRIES} writes")

    async def add_event(self, route: Route, kind: str, message: str) -> None:
        event = Event(ts=time.time(), kind=kind, message=message, stable=route.stable,
                      canary=route.canary, weight=route.weight)
        pipe = self.redis.pipeline(transaction=True)
        pipe.lpush(names.canary_events(route.alias), event.model_dump_json())
        pipe.ltrim(names.canary_events(route.alias), 0, MAX_EVENTS - 1)
        await pipe.execute()

    async def events(self, alias: str, n: int = 20) -> list[Event]:
        return [Event.model_validate_json(e)
                for e in await self.redis.lrange(names.canary_events(alias), 0, n - 1)]

    async def count(self, alias: str, counter: str, n: int = 1) -> None:
        await self.redis.hincrby(names.canary_counters(alias), counter, n)

    async def counters(self, alias: str) -> dict[str, int]:
        raw = await self.redis.hgetall(names.canary_counters(alias))
        return {k.decode(): int(v) for k, v in raw.items()}


def new_route(alias: str, stable: str, canary: str, now: float | None = None, **fields) -> Route:
    now = now or time.time()
    return Route(alias=alias, stable=stable, canary=canary, started=now, step_started=now,
                 updated=now, **fields)


# -- transitions: the only ways a route on trial changes (admin API and periodic check alike) ---
def promoted(route: Route) -> Route:
    return route.model_copy(update={"stable": route.canary, "canary": None, "weight": 0.0,
                                    "steps": [], "paused": False, "phase": "promoted",
                                    "step_started": time.time()})


def rolled_back(route: Route, reason: str) -> Route:
    return route.model_copy(update={"weight": 0.0, "phase": "rolled_back", "reason": reason,
                                    "step_started": time.time()})


def weighted(route: Route, weight: float) -> Route:
    return route.model_copy(update={"weight": weight, "step_started": time.time()})


def paused(route: Route, pause: bool) -> Route:
    """Resuming restarts the step's interval: the time paused does not count as time passed (a
    route already as asked is left as it is: resuming one never paused keeps its step's time)."""
    if route.paused == pause:
        return route
    update = {"paused": pause} if pause else {"paused": False, "step_started": time.time()}
    return route.model_copy(update=update)
