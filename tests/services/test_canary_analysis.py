"""The canary analysis on a real Redis: windows written the way gateways write them, the check the
Celery beat task runs, called directly."""
from __future__ import annotations

import secrets
import time
from collections import Counter

import pytest
import redis.asyncio as aioredis

from services.canary import check_route
from shared import canary, canary_stats
from shared.canary import RouteStore, Thresholds


@pytest.fixture
async def client(redis_server):
    c = aioredis.Redis.from_url(redis_server.url)
    yield c
    await c.aclose()


async def _route(client, **fields) -> canary.Route:
    alias = "chat-" + secrets.token_hex(4)
    fields.setdefault("thresholds", Thresholds(min_samples=20, window_s=60))
    route = canary.new_route(alias, "v1", "v2", now=time.time() - 1, **fields)
    stored, _ = await RouteStore(client).change(alias, lambda _: route)
    return stored


async def _traffic(client, route, version: str, n: int, errors: int = 0, ttft_ms: float = 20.0,
                   tpot_ms: float = 5.0) -> None:
    for i in range(n):
        await canary_stats.record(client, route.alias, version, route.thresholds.window_s,
                                  ok=i >= errors, ttft_ms=ttft_ms, tpot_ms=tpot_ms)


def test_percentiles_from_the_histogram_err_at_most_five_percent_high():
    hist = Counter(canary_stats.latency_bin(ms) for ms in range(1, 101))
    p95 = canary_stats.percentile(hist, 0.95)
    assert 95 <= p95 <= 95 * 1.05


async def test_failing_success_rate_rolls_back_with_the_reason(client):
    route = await _route(client, weight=10)
    await _traffic(client, route, "v1", 50)
    await _traffic(client, route, "v2", 10, errors=5)
    assert (await check_route(client, route.alias)).startswith("hold: 10 of 20 samples")
    await _traffic(client, route, "v2", 10)
    outcome = await check_route(client, route.alias)
    assert outcome.startswith("rollback: success rate 75.0% < 99.0% over 20 requests"), outcome
    store = RouteStore(client)
    after = await store.get(route.alias)
    assert (after.phase, after.weight, after.canary) == ("rolled_back", 0.0, "v2")
    assert "success rate 75.0%" in after.reason
    assert (await store.counters(route.alias))["rollbacks"] == 1
    assert (await store.events(route.alias))[0].kind == "rollback"
    assert await check_route(client, route.alias) == "no canary on trial"


async def test_slow_first_token_rolls_back_only_against_enough_stable_samples(client):
    route = await _route(client, weight=50)
    await _traffic(client, route, "v2", 30, ttft_ms=80)
    await _traffic(client, route, "v1", 10, ttft_ms=20)  # too few to compare with
    assert (await check_route(client, route.alias)).startswith("hold")
    await _traffic(client, route, "v1", 10, ttft_ms=20)
    outcome = await check_route(client, route.alias)
    assert outcome.startswith("rollback: TTFT p95 8") and "> 1.5x stable's 2" in outcome, outcome


async def test_staged_rollout_advances_only_while_passing_and_promotes_at_the_end(client):
    route = await _route(client, weight=10, steps=[10, 50, 100], interval_s=5)
    store = RouteStore(client)
    later = time.time() + 6  # the interval is over
    assert (await check_route(client, route.alias, now=later)).startswith("hold: 0 of 20")
    await _traffic(client, route, "v1", 20)
    await _traffic(client, route, "v2", 20)
    assert (await check_route(client, route.alias)).startswith("hold: interval not over")
    assert (await check_route(client, route.alias, now=later)).startswith("advance")
    assert (await store.get(route.alias)).weight == 50
    await store.change(route.alias, lambda r: canary.paused(r, True))
    assert (await check_route(client, route.alias, now=time.time() + 6)).startswith("hold")
    await store.change(route.alias, lambda r: canary.paused(r, False))
    assert (await check_route(client, route.alias, now=time.time() + 6)).startswith("promote")
    after = await store.get(route.alias)
    assert (after.stable, after.canary, after.phase) == ("v2", None, "promoted")
    assert [e.kind for e in await store.events(route.alias)] == ["promote", "advance"]


async def test_a_failing_canary_never_advances(client):
    route = await _route(client, weight=10, steps=[10, 50, 100], interval_s=1)
    await _traffic(client, route, "v1", 20)
    await _traffic(client, route, "v2", 20, errors=2)
    assert (await check_route(client, route.alias, now=time.time() + 2)).startswith("rollback")
    assert (await RouteStore(client).get(route.alias)).weight == 0
