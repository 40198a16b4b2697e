"""Stream leases (gateway/stream_leases.py) on a real Redis: a holder's renewals keep its lease from
the sweepers, a lapsed one is settled once, and only its own key finds it."""
from __future__ import annotations

import time

import pytest

from gateway.holdings import Holdings
from gateway.limits import Limits, Reservation
from gateway.stream_leases import ABANDONED, CLAIM_SETTLE, Attach, StreamLease, StreamLeases
from shared import names
from shared.settings import GatewaySettings
from shared.usage import UsageBook, utc_day


@pytest.fixture
def client(aredis):
    return aredis


def _leases(client, gateway_id: str, cancelled: list) -> StreamLeases:
    settings = GatewaySettings(secret="s")
    return StreamLeases(client, gateway_id, 0.0, Limits(client, settings), UsageBook(client, 30),
                        lambda rid, why: cancelled.append(rid))


async def _open(leases: StreamLeases, client, key_id="k1", request_id="cmpl-1") -> StreamLease:
    lease = StreamLease(key_id, request_id)
    await client.zadd(names.inflight_key(key_id), {"slot-1": time.time() + 600})
    held = Holdings(key_id, "slot-1", Reservation(key_id, int(time.time()), utc_day(), 100), "demo", "v1")
    await leases.open(lease, held, time.time() + 60, {"kind": "completion"}, request_id)
    return lease


async def _until(client, lease) -> float:
    return float(await client.hget(lease.name, "until"))


async def test_renewal_keeps_a_held_lease_from_the_sweepers(client):
    cancelled: list = []
    a, b = _leases(client, "gw-a", cancelled), _leases(client, "gw-b", cancelled)
    lease = await _open(a, client)
    # one pipeline wrote the lease and its open-streams entry; the lease names the channel its
    # worker publishes to, which a gateway resuming it listens on (tests/gateway/test_log_follower.py)
    assert await client.zscore(names.OPEN_STREAMS, lease.member) is not None
    assert (await client.hget(lease.name, "channel")).decode() == names.reply_channel("gw-a")
    await client.hset(lease.name, "until", repr(time.time() - 10))  # as if the hold had run out
    await a.renew()
    assert await _until(client, lease) > time.time() + 1
    assert await b.sweep() == 0 and not cancelled
    assert await client.zcard(names.inflight_key("k1")) == 1


async def test_a_lapsed_lease_is_settled_once_and_its_request_cancelled(client):
    cancelled: list = []
    a, b = _leases(client, "gw-a", cancelled), _leases(client, "gw-b", cancelled)
    lease = await _open(a, client)
    a.held.clear()  # its gateway died: nobody renews
    await client.hset(lease.name, "until", repr(time.time() - 10))
    await client.zadd(names.OPEN_STREAMS, {lease.member: time.time() - 10})
    assert await b.sweep() + await a.sweep() == 1
    assert cancelled == ["cmpl-1"]
    assert await client.hget(lease.name, "settled") == ABANDONED.encode()
    assert await client.zcard(names.inflight_key("k1")) == 0  # the slot is freed
    usage = await client.hgetall(names.usage_key("k1", utc_day()))
    assert usage == {b"demo|v1|requests": b"1", b"demo|v1|errors": b"1"}
    assert await client.zcard(names.OPEN_STREAMS) == 0
    assert await b.attach(lease) == Attach.SETTLED
    assert await b.attach(StreamLease("k2", "cmpl-1")) == Attach.GONE  # another key finds nothing


async def test_the_holder_ends_its_stream_claimed_and_settled_in_one_script(client):
    """`end`: the claim, the open-streams entry dropped and the settlement in one round trip, once."""
    a = _leases(client, "gw-a", [])
    lease = await _open(a, client)
    reservation = Reservation("k1", int(time.time()), utc_day(), 100)
    await client.set(names.daily_tokens_key("k1", utc_day()), 100)  # charged at admission
    held = Holdings("k1", "slot-1", reservation, "demo", "v1")
    usage = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    await client.script_load(CLAIM_SETTLE)  # as after a gateway's first stream
    commands = []
    send = client.connection_pool.connection_class.send_packed_command

    async def counted(conn, command, check_health=True):
        commands.append(command)
        return await send(conn, command, check_health)

    client.connection_pool.connection_class.send_packed_command = counted
    try:
        assert await a.end(lease, "done", held, usage, refused=False) is True
    finally:
        client.connection_pool.connection_class.send_packed_command = send
    assert len(commands) == 1 and b"EVALSHA" in commands[0][0]  # one round trip
    assert await client.hget(lease.name, "settled") == b"done"
    assert await client.zscore(names.OPEN_STREAMS, lease.member) is None
    assert await client.zcard(names.inflight_key("k1")) == 0
    assert int(await client.get(names.daily_tokens_key("k1", utc_day()))) == 12  # 100 replaced by 12
    counted_usage = await client.hgetall(names.usage_key("k1", utc_day()))
    assert counted_usage == {b"demo|v1|requests": b"1", b"demo|v1|prompt_tokens": b"7",
                             b"demo|v1|completion_tokens": b"5"}
    # settled once: a second end (or a sweeper) finds it settled and changes nothing
    assert await a.end(lease, "done", held, usage, refused=False) is False
    assert int(await client.get(names.daily_tokens_key("k1", utc_day()))) == 12
    assert await client.hgetall(names.usage_key("k1", utc_day())) == counted_usage
