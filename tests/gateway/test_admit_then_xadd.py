"""The key's limits and the bounded XADD in one round trip (gateway/dispatch.py `_ADMIT_THEN_XADD`),
on a real Redis: what the limits refuse is never added, what they admit is added with its
reservation made, and a request that must wait for its place on the stream has its limits
checked before it waits (on their own), as before they could share a round trip."""
from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from gateway.dispatch import Dispatcher
from gateway.keys import KeyRecord
from gateway.limits import Limits
from shared import names, protocol
from shared.errors import RateLimited
from shared.settings import GatewaySettings
from shared.usage import utc_day

STREAM = names.request_stream("demo", "v1", names.DEFAULT_LANE)


@pytest.fixture
def client(aredis):
    return aredis


def _key(**limits) -> KeyRecord:
    return KeyRecord(id="key_trip", name="trip", created=time.time(), **limits)


def _entry(request_id: str) -> protocol.RequestEntry:
    return protocol.RequestEntry(request_id=request_id, reply_channel=names.reply_channel("adm-test"),
                                 model="demo", version="v1", kind="completion", prompt="hi",
                                 key_id="key_trip", created=time.time(), deadline=time.time() + 30)


class Counted:
    """The script calls a dispatcher makes: which of its scripts ran, how often."""

    def __init__(self, d: Dispatcher):
        self.calls: list[str] = []
        for name in ("_xadd_bounded", "_admit_then_xadd"):
            script = getattr(d, name)

            async def counted(*args, _script=script, _name=name, **kwargs):
                self.calls.append(_name)
                return await _script(*args, **kwargs)
            setattr(d, name, counted)


async def test_limits_admit_and_add_in_one_script_and_refuse_without_adding(client):
    limits = Limits(client, GatewaySettings(secret="s"))
    d = Dispatcher(client, "adm-test")
    await d.start()
    try:
        counted = Counted(d)
        key = _key(rpm=1)
        admitted = []
        call = limits.prepare(key, count=True, estimate=10)
        first = dataclasses.replace(call, conclude=lambda answer: admitted.append(call.conclude(answer)))
        handle = await d.submit(STREAM, _entry("cmpl-1"), before=first)
        assert counted.calls == ["_admit_then_xadd"] and len(admitted) == 1
        assert admitted[0].reservation.estimate == 10
        assert await client.xlen(STREAM) == 1
        assert int(await client.get(names.daily_tokens_key(key.id, utc_day()))) == 10
        handle.close()
        with pytest.raises(RateLimited, match="requests per minute"):  # rpm 1: the second is over
            await d.submit(STREAM, _entry("cmpl-2"), before=limits.prepare(key, count=True, estimate=10))
        assert counted.calls == ["_admit_then_xadd"] * 2
        assert await client.xlen(STREAM) == 1  # nothing added
        assert int(await client.get(names.daily_tokens_key(key.id, utc_day()))) == 10  # nor reserved
        assert "cmpl-2" not in d.queues
    finally:
        await d.stop()


async def test_a_request_that_must_wait_for_its_place_has_its_limits_checked_first(client):
    limits = Limits(client, GatewaySettings(secret="s"))
    d = Dispatcher(client, "adm-test", queued_per_key=1)  # one place on the stream per key
    await d.start()
    try:
        counted = Counted(d)
        key = _key(tpm=15)
        held = await d.submit(STREAM, _entry("cmpl-a"), before=limits.prepare(key, estimate=10))
        assert counted.calls == ["_admit_then_xadd"]  # its place was free: one round trip
        # the place is taken: the next request's limits run alone, before any wait, and refuse it
        # at once (tokens per minute) instead of after the wait
        started = time.monotonic()
        with pytest.raises(RateLimited, match="tokens per minute"):
            await d.submit(STREAM, _entry("cmpl-b"), before=limits.prepare(key, estimate=10))
        assert time.monotonic() - started < 5 and counted.calls == ["_admit_then_xadd"]
        # one the limits admit waits for the place, then is added by the XADD alone
        ok = limits.prepare(key, estimate=1)
        waiting = asyncio.ensure_future(d.submit(STREAM, _entry("cmpl-c"), before=ok))
        await asyncio.sleep(0.2)
        assert not waiting.done() and await client.xlen(STREAM) == 1
        held.admitted()  # the first one's worker took it: the place passes on
        (await asyncio.wait_for(waiting, 5)).close()
        assert counted.calls == ["_admit_then_xadd", "_xadd_bounded"]
        assert await client.xlen(STREAM) == 2
        held.close()
    finally:
        await d.stop()


async def test_a_redis_out_of_memory_takes_nothing(client):
    """Out of memory, the one script refuses before its first write (ADMIT's clean-ups would
    otherwise let the XADD through): no entry, no request counted, nothing reserved."""
    limits = Limits(client, GatewaySettings(secret="s"))
    d = Dispatcher(client, "adm-test")
    await d.start()
    key = _key(rpm=100)
    await client.zadd(names.rpm_key(key.id), {"old": time.time() - 3600})  # a clean-up to do first
    try:
        await client.config_set("maxmemory-policy", "noeviction")
        await client.config_set("maxmemory", "1")
        with pytest.raises(Exception, match="out of memory"):
            await d.submit(STREAM, _entry("cmpl-oom"), before=limits.prepare(key, count=True, estimate=10))
    finally:
        await client.config_set("maxmemory", "0")
        await d.stop()
    assert await client.xlen(STREAM) == 0
    assert await client.zrange(names.rpm_key(key.id), 0, -1) == [b"old"]  # not even the clean-up
    assert await client.get(names.daily_tokens_key(key.id, utc_day())) is None


async def test_a_handle_closed_twice_publishes_one_cancel(client):
    """The generator's `finally` and the response's background task both close a handle: its
    cancel goes out once."""
    d = Dispatcher(client, "adm-test")
    await d.start()
    cancels = client.pubsub()
    try:
        await cancels.subscribe(names.CANCEL_CHANNEL)
        handle = await d.submit(STREAM, _entry("cmpl-twice"))
        handle.close("client_disconnected")
        handle.close("client_disconnected")
        await handle.aclose("client_disconnected")
        heard = []
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            message = await cancels.get_message(ignore_subscribe_messages=True, timeout=0.2)
            if message is not None:
                heard.append(protocol.decode_cancel(message["data"]).request_id)
        assert heard == ["cmpl-twice"]
        assert await client.exists(names.cancelled_key("cmpl-twice"))
    finally:
        await cancels.aclose()
        await d.stop()
