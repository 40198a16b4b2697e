"""A resumed stream's follower (gateway/dispatch.py LogFollower) on a real Redis: it listens on the
channel its worker publishes to (the dispatching gateway's, named in the stream's lease) and reads
its reply log when a step is published there, not at its next poll; it stops listening when done."""
from __future__ import annotations

import asyncio
import time

import pytest

from gateway import dispatch
from gateway.dispatch import Dispatcher, LogFollower
from shared import names, protocol


@pytest.fixture
def client(aredis):
    return aredis


async def _listeners(client, channel: str) -> int:
    return dict(await client.pubsub_numsub(channel))[channel.encode()]


async def _eventually(check, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "not within the timeout"
        await asyncio.sleep(0.02)


async def _step(client, channel: str, reply) -> None:
    """What a worker does with a step's reply: appends it to the log and publishes it."""
    await client.rpush(names.checkpoint_key(reply.request_id), protocol.encode(reply))
    await client.publish(channel, b"[" + protocol.encode(reply) + b"]")


async def test_a_follower_reads_its_log_when_its_worker_publishes(client, monkeypatch):
    monkeypatch.setattr(dispatch, "FOLLOW_WAKE_S", 30.0)  # only a message can wake it in time
    gone = names.reply_channel("gw-dead")  # the dispatching gateway: killed, its channel still used
    here = Dispatcher(client, "gw-here")
    await here.start()
    try:
        follower = LogFollower(here, "cmpl-f", time.time() + 60, gone)
        replies = follower.replies(keepalive_s=60)
        first = asyncio.ensure_future(anext(replies))
        await _eventually(lambda: _numsub_is(client, gone, 1))
        await _step(client, gone, protocol.Delta(request_id="cmpl-f", seq=1, text="a", token_ids=[7]))
        got = await asyncio.wait_for(first, timeout=5)
        assert isinstance(got, protocol.Delta) and got.seq == 1 and got.text == "a"
        nxt = asyncio.ensure_future(anext(replies))
        await asyncio.sleep(0.1)  # waiting on the channel again
        await _step(client, gone, protocol.Done(request_id="cmpl-f", seq=2, prompt_tokens=3,
                                                completion_tokens=1))
        assert isinstance(await asyncio.wait_for(nxt, timeout=5), protocol.Done)
        with pytest.raises(StopAsyncIteration):
            await anext(replies)
        follower.close()
        await _eventually(lambda: _numsub_is(client, gone, 0))  # stops listening once done
        assert here.wakers == {} and here.watched == {}
    finally:
        await here.stop()


async def test_two_followers_of_one_channel_share_its_subscription(client):
    channel = names.reply_channel("gw-other")
    here = Dispatcher(client, "gw-here2")
    await here.start()
    try:
        a = await here.watch(channel, "cmpl-a")
        b = await here.watch(channel, "cmpl-b")
        await _eventually(lambda: _numsub_is(client, channel, 1))
        await client.publish(channel, b'[{"v":6,"type":"delta","request_id":"cmpl-b","seq":1}]')
        await asyncio.wait_for(b.wait(), timeout=5)
        assert not a.is_set()  # only the request the message names
        here.unwatch(channel, "cmpl-a", a)
        here.unwatch(channel, "cmpl-a", a)  # twice: the second does nothing
        await asyncio.sleep(0.1)
        assert await _listeners(client, channel) == 1  # b still follows
        here.unwatch(channel, "cmpl-b", b)
        await _eventually(lambda: _numsub_is(client, channel, 0))
    finally:
        await here.stop()


async def _numsub_is(client, channel: str, n: int) -> bool:
    return await _listeners(client, channel) == n
