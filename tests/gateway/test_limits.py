"""The limiter against a real Redis, with two Limits objects on two connections standing in for two
gateway replicas: counts are exact because every check-and-increment is one Lua script."""
from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from gateway.admission import GENERATING
from gateway.auth import COUNTED_POSTS
from gateway.keys import KeyRecord
from gateway.limits import FullMinutes, Limits, duration
from shared import names
from shared.errors import RateLimited
from shared.settings import GatewaySettings


@pytest.fixture
async def replicas(redis_server):
    settings = GatewaySettings(redis_url=redis_server.url, secret="s", request_timeout_s=30)
    clients = [aioredis.Redis.from_url(redis_server.url) for _ in range(2)]
    yield [Limits(c, settings) for c in clients]
    for c in clients:
        await c.aclose()


def _key(**limits) -> KeyRecord:
    import secrets

    return KeyRecord(id="key_" + secrets.token_hex(6), name="t", created=0.0, **limits)


async def _outcomes(calls) -> list[bool]:
    async def one(call):
        try:
            await call
            return True
        except RateLimited:
            return False
    return await asyncio.gather(*(one(c) for c in calls))


async def test_rpm_admits_exactly_the_limit_across_replicas(replicas):
    key = _key(rpm=50)
    ok = await _outcomes(replicas[i % 2].count_request(key) for i in range(200))
    assert sum(ok) == 50


async def test_rpm_refusal_names_the_limit_and_when_to_retry(replicas):
    key = _key(rpm=1)
    headers = await replicas[0].count_request(key)
    assert headers["x-ratelimit-limit-requests"] == "1"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(RateLimited) as err:
        await replicas[1].count_request(key)
    assert "requests per minute" in err.value.message and 0 < err.value.retry_after <= 60
    assert err.value.headers["x-ratelimit-remaining-requests"] == "0"


async def test_slots_cap_in_flight_and_come_back_when_released(replicas):
    key = _key(max_concurrent=4)
    ok = await _outcomes(replicas[i % 2].acquire_slot(key, f"r{i}") for i in range(40))
    assert sum(ok) == 4
    held = [f"r{i}" for i, good in enumerate(ok) if good]
    await replicas[0].release_slot(key, held[0])
    assert await replicas[1].acquire_slot(key, "again")
    with pytest.raises(RateLimited, match="concurrent"):
        await replicas[0].acquire_slot(key, "one-too-many")


async def test_a_dead_gateways_slot_ages_out(replicas, redis_server):
    key = _key(max_concurrent=1)
    await replicas[0].acquire_slot(key, "orphan")
    client = replicas[0].redis
    await client.zadd(names.inflight_key(key.id), {"orphan": 1.0})  # its expiry has passed
    assert await replicas[1].acquire_slot(key, "fresh")


async def test_tokens_reserved_atomically_then_settled(replicas):
    key = _key(tpm=1000)
    ok = await _outcomes(replicas[i % 2].reserve_tokens(key, 30) for i in range(100))
    assert sum(ok) == 33  # 33 * 30 = 990 <= 1000 < 34 * 30
    with pytest.raises(RateLimited, match=r"tokens per minute \(TPM\): Limit 1000, Used 990"):
        await replicas[0].reserve_tokens(key, 30)
    reservation, _ = await replicas[0].reserve_tokens(key, 10)
    await replicas[1].settle_tokens(reservation, 4)  # refund 6
    headers = await replicas[0].token_window(key)
    assert headers["x-ratelimit-remaining-tokens"] == str(1000 - 990 - 4)


async def test_settling_more_than_reserved_charges_the_difference(replicas):
    key = _key(tpm=100)
    reservation, _ = await replicas[0].reserve_tokens(key, 10)
    await replicas[0].settle_tokens(reservation, 95)
    with pytest.raises(RateLimited):
        await replicas[1].reserve_tokens(key, 10)
    await replicas[1].reserve_tokens(key, 5)


async def test_daily_budget_is_its_own_limit(replicas):
    key = _key(tpm=10_000, daily_tokens=100)
    ok = await _outcomes(replicas[i % 2].reserve_tokens(key, 30) for i in range(10))
    assert sum(ok) == 3
    with pytest.raises(RateLimited) as err:
        await replicas[0].reserve_tokens(key, 30)
    assert err.value.code == "insufficient_quota" and "Daily token budget" in err.value.message
    assert err.value.retry_after <= 86400


async def test_counters_carry_ttls(replicas):
    key = _key(tpm=100, max_concurrent=2, rpm=5)
    await replicas[0].count_request(key)
    await replicas[0].acquire_slot(key, "r")
    await replicas[0].reserve_tokens(key, 1)
    client = replicas[0].redis
    found = [k async for k in client.scan_iter(match=f"*{key.id}*")]
    assert len(found) >= 4
    assert all([await client.ttl(k) > 0 for k in found])


def test_reset_durations_read_like_openais():
    assert duration(0.02) == "20ms"
    assert duration(17) == "17s"
    assert duration(60) == "1m0s"
    assert duration(59.2) == "1m0s"


async def test_a_full_minute_is_known_where_admit_said_so_until_it_moves_on(replicas):
    key = _key(rpm=1)
    await replicas[0].count_request(key)
    assert replicas[0].known_full(key) is None  # full, but nobody was refused yet
    with pytest.raises(RateLimited) as said:
        await replicas[0].count_request(key)
    known = replicas[0].known_full(key)
    assert known is not None and known.message.split("again in")[0] == said.value.message.split("again in")[0]
    assert 0 < known.retry_after <= said.value.retry_after <= 60
    assert known.headers["x-ratelimit-remaining-requests"] == "0"
    tokens = ("x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens")  # where the tokens stood, as said then
    assert [known.headers[h] for h in tokens] == [said.value.headers[h] for h in tokens]
    assert "x-ratelimit-reset-tokens" in known.headers
    assert replicas[1].known_full(key) is None  # another replica asks Redis (and learns it there)
    assert replicas[0].known_full(key.model_copy(update={"rpm": 2})) is None  # its limit changed
    assert replicas[0].known_full(key) is None  # and the entry is gone with it


def test_full_minutes_end_and_stay_bounded(monkeypatch):
    minutes = FullMinutes()
    minutes.full("a", 5, time.monotonic() - 0.01)
    assert minutes.wait("a", 5) is None
    minutes.full("b", 5, time.monotonic() + 30)
    assert 29 < minutes.wait("b", 5) <= 30 and minutes.wait("b", 6) is None
    monkeypatch.setattr(FullMinutes, "BOUND", 3)
    for i in range(10):
        minutes.full(f"k{i}", 5, time.monotonic() + 30)
    assert len(minutes._until) <= 3 and minutes.wait("k9", 5) is not None


def test_every_generation_route_is_refused_before_its_body_when_full():
    assert GENERATING <= COUNTED_POSTS
