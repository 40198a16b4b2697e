"""The canary analysis: compare each canary with its stable over the route's window, then roll
back (weight 0) on failure, advance a step or promote when it passes and the interval is up, or
hold. Plain functions: the Celery beat task runs `run_checks` every KVGATE_CANARY_CHECK_S, tests
call them directly.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Literal

import redis.asyncio as aioredis

from shared import canary, canary_stats
from shared.canary import Route, RouteStore
from shared.canary_stats import WindowStats, percentile
from shared.redis_client import async_client
from shared.settings import CommonSettings

log = logging.getLogger("kvgate.services.canary")


@dataclass
class Verdict:
    result: Literal["pass", "fail", "wait"]  # wait: too few samples to judge yet
    reason: str


@dataclass
class Action:
    kind: Literal["rollback", "advance", "promote", "hold"]
    reason: str
    weight: float | None = None


def analyse(route: Route, stable: WindowStats, trial: WindowStats) -> Verdict:
    """Canary against thresholds: its success rate alone, its latency p95 against stable's (once
    stable too has `min_samples` in the window)."""
    t = route.thresholds
    if trial.requests < t.min_samples:
        return Verdict("wait", f"{trial.requests} of {t.min_samples} samples")
    if trial.success_rate < t.min_success_rate:
        return Verdict("fail", f"success rate {trial.success_rate:.1%} < {t.min_success_rate:.1%} "
                               f"over {trial.requests} requests")
    if stable.requests >= t.min_samples:
        for name, limit in (("TTFT", t.max_ttft_ratio), ("TPOT", t.max_tpot_ratio)):
            hist = name.lower()
            ours, theirs = percentile(getattr(trial, hist), 0.95), percentile(getattr(stable, hist), 0.95)
            if limit is not None and ours is not None and theirs is not None and ours > limit * theirs:
                return Verdict("fail", f"{name} p95 {ours:.0f} ms > {limit:g}x stable's "
                                       f"{theirs:.0f} ms")
    return Verdict("pass", f"success rate {trial.success_rate:.1%} over {trial.requests} requests")


def decide(route: Route, verdict: Verdict, now: float) -> Action:
    """What the verdict means for the route: only a passing canary moves forward."""
    if verdict.result == "fail":
        return Action("rollback", verdict.reason)
    if verdict.result == "wait" or route.paused or not route.steps:
        return Action("hold", verdict.reason)
    if now - route.step_started < (route.interval_s or 0):
        return Action("hold", "interval not over")
    following = next((s for s in route.steps if s > route.weight), None)
    if following is None or following >= 100:
        return Action("promote", verdict.reason)
    return Action("advance", verdict.reason, weight=following)


async def check_route(redis: aioredis.Redis, alias: str, now: float | None = None) -> str:
    """Analyse one alias and act; what happened, in a few words."""
    store = RouteStore(redis)
    route = await store.get(alias)
    if route is None or not route.on_trial:
        return "no canary on trial"
    now = now or time.time()
    t = route.thresholds
    stats = await canary_stats.read(redis, alias, [route.stable, route.canary], t.window_s,
                                    since=route.started, now=now)
    action = decide(route, analyse(route, stats[route.stable], stats[route.canary]), now)
    if action.kind == "hold":
        return f"hold: {action.reason}"
    edit = {"rollback": lambda r: canary.rolled_back(r, action.reason),
            "advance": lambda r: canary.weighted(r, action.weight),
            "promote": canary.promoted}[action.kind]
    # act only on the route that was analysed: an admin's change in between wins
    new, changed = await store.change(alias, lambda r: edit(r) if r == route else None)
    if not changed:
        return "route changed meanwhile"
    await _record(store, route, new, action)
    return f"{action.kind}: {action.reason}"


async def _record(store: RouteStore, old: Route, new: Route, action: Action) -> None:
    if action.kind == "rollback":
        message = f"{old.canary} rolled back automatically: {action.reason}"
        log.warning("canary %s: %s", old.alias, message)
        await store.count(old.alias, "rollbacks")
        on_rollback(old, action.reason)
    elif action.kind == "advance":
        message = f"{old.canary} advanced {old.weight:g}% -> {new.weight:g}% ({action.reason})"
        log.info("canary %s: %s", old.alias, message)
    else:
        message = f"{old.canary} promoted to stable ({action.reason})"
        log.info("canary %s: %s", old.alias, message)
        await store.count(old.alias, "promotions")
    await store.add_event(new, action.kind, message)


def on_rollback(route: Route, reason: str) -> None:
    """Hook for whatever else must hear of a rollback. Prometheus needs nothing here: this Celery
    process has no /metrics, so the gateway exports the Redis counter `rollbacks` (counted above)
    as `kvgate_canary_rollbacks_total{trigger="automatic"}` (gateway/metrics.py)."""


async def check_all(redis: aioredis.Redis) -> dict[str, str]:
    return {alias: await check_route(redis, alias) for alias in await RouteStore(redis).aliases()}


def run_checks(settings: CommonSettings) -> dict[str, str]:
    """One pass over every route, from synchronous code (the Celery task)."""
    async def once() -> dict[str, str]:
        client = async_client(settings, socket_connect_timeout=2, socket_timeout=5)
        try:
            return await check_all(client)
        finally:
            await client.aclose()
    return asyncio.run(once())
