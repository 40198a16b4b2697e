"""A gateway's Redis pool follows its load down (shared/redis_client.IdleClosingPool,
gateway/pool_trim.py): a burst's connections close once idle, on a real redis-server, and the pool
goes on serving. The soak found Redis memory growing with connections a burst had opened and nothing
ever closed."""
from __future__ import annotations

import asyncio

import redis

from gateway.metrics import REDIS_CONNECTIONS
from gateway.pool_trim import PoolTrim
from shared.redis_client import IdleClosingPool, async_client
from shared.settings import CommonSettings, GatewaySettings

BURST = 20


def _clients(observer: redis.Redis) -> int:
    """Connections the server holds, less the observer's own."""
    return len(observer.client_list()) - 1


async def _settled(observer: redis.Redis, expected: int) -> int:
    """The server's count once it has seen the closes (it reads them on its next loop)."""
    for _ in range(40):
        if (count := _clients(observer)) == expected:
            return count
        await asyncio.sleep(0.05)
    return _clients(observer)


async def _burst(client) -> None:
    # each BLPOP holds its connection for 0.2 s, so the pool must open one per caller
    await asyncio.gather(*(client.blpop([f"pool-trim:none:{i}"], timeout=0.2) for i in range(BURST)))


async def test_a_bursts_connections_close_once_idle_and_the_pool_goes_on(redis_server):
    observer = redis.Redis.from_url(redis_server.url)
    before = _clients(observer)
    client = async_client(CommonSettings(redis_url=redis_server.url), max_connections=64)
    pool = client.connection_pool
    assert isinstance(pool, IdleClosingPool)
    try:
        await _burst(client)
        assert _clients(observer) - before >= BURST
        assert pool.counts() == (BURST, 0)

        assert await pool.close_idle(60) == 0  # none idle that long: nothing closed
        assert _clients(observer) - before >= BURST

        # a steady trickle keeps reusing the most recently released connection; the rest go idle
        for _ in range(8):
            await client.ping()
            await asyncio.sleep(0.05)
        closed = await pool.close_idle(0.2)
        assert BURST - 2 <= closed < BURST
        assert await _settled(observer, before + BURST - closed) == before + BURST - closed
        assert await client.set("pool-trim:k", "v") and await client.get("pool-trim:k") == b"v"

        await pool.close_idle(0)
        assert await _settled(observer, before) == before
        await _burst(client)  # a later burst opens them again, up to max_connections
        assert _clients(observer) - before >= BURST
    finally:
        await client.aclose()
        await client.connection_pool.disconnect()  # a pool handed in is not closed with its client
        await _settled(observer, before)  # the next test counts from a server that saw these close
        observer.close()


async def test_the_gateways_trim_loop_closes_idle_connections_and_shows_the_pool(redis_server):
    observer = redis.Redis.from_url(redis_server.url)
    before = _clients(observer)
    client = async_client(CommonSettings(redis_url=redis_server.url), max_connections=64)
    trim = PoolTrim(client.connection_pool, idle_s=0.3)
    trim.start()
    try:
        await _burst(client)
        assert _clients(observer) - before >= BURST
        await asyncio.sleep(0.6)  # past the idle time and one pass of the loop
        assert await _settled(observer, before) == before
        assert REDIS_CONNECTIONS.labels("idle")._value.get() == 0
        assert REDIS_CONNECTIONS.labels("in_use")._value.get() == 0
        assert await client.ping()
    finally:
        trim.stop()
        await client.aclose()
        await client.connection_pool.disconnect()  # a pool handed in is not closed with its client
        await _settled(observer, before)
        observer.close()


async def test_the_gateway_state_trims_its_own_pool(redis_server):
    from gateway.state import GatewayState
    from gateway.throttle import Throttle

    settings = GatewaySettings(redis_url=redis_server.url, secret="s", redis_idle_timeout_s=5)
    state = GatewayState.connect(settings, Throttle(10, 10))
    try:
        assert state.pool_trim.pool is state.redis.connection_pool
        assert state.pool_trim.idle_s == 5
    finally:
        await state.redis.aclose()
