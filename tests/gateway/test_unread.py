"""A client that stops reading costs the gateway a bounded amount (gateway/reply_queue.py), on a real
Redis: replies published as a worker publishes them pile up in the request's queue until its bound,
then the request ends with client_not_reading (its replies dropped, its worker told to stop);
past the gateway's bound in all, the request with the most unread ends, not the others."""
from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from gateway.dispatch import Dispatcher, Handle
from gateway.reply_queue import Unread
from shared import names, protocol
from shared.errors import ClientNotReading
from tests.conftest import wire_entry

STREAM = names.request_stream("demo", "v1")


async def _started(client, unread: Unread) -> Dispatcher:
    dispatcher = Dispatcher(client, "gw-unread", unread=unread)
    await dispatcher.start()
    return dispatcher


async def _publish(client, dispatcher: Dispatcher, request_id: str, seqs: range) -> None:
    """One worker step per reply, as a worker publishes them to the dispatching gateway."""
    for seq in seqs:
        delta = protocol.Delta(request_id=request_id, seq=seq, text="x", token_ids=[7],
                               logprobs=[{"token": "x", "logprob": -0.1}])
        await client.publish(dispatcher.channel, b"[" + protocol.encode(delta) + b"]")


async def _until(check, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the timeout"
        await asyncio.sleep(0.01)


async def _cancels(client) -> tuple[asyncio.Task, list[dict]]:
    heard: list[dict] = []
    pubsub = client.pubsub()
    await pubsub.subscribe(names.CANCEL_CHANNEL)

    async def listen():
        async for message in pubsub.listen():
            if message["type"] == "message":
                heard.append(orjson.loads(message["data"]))
    return asyncio.create_task(listen()), heard


async def test_a_request_past_its_bound_ends_and_its_worker_is_told(aredis):
    dispatcher = await _started(aredis, Unread(per_request=50, in_all=10_000))
    listener, cancels = await _cancels(aredis)
    try:
        queue = await dispatcher.enqueue(STREAM, wire_entry("cmpl-slow", dispatcher.channel), True, None)
        await _publish(aredis, dispatcher, "cmpl-slow", range(1, 50))
        await _until(lambda: queue.qsize() == 49)
        assert dispatcher.unread.count == 49  # within the bound: every reply kept, none read
        await _publish(aredis, dispatcher, "cmpl-slow", range(50, 80))
        await _until(lambda: "cmpl-slow" not in dispatcher.queues)
        assert queue.qsize() == 1 and dispatcher.unread.count == 0  # its replies dropped
        handle = Handle(dispatcher, "cmpl-slow", queue, time.time() + 60)
        with pytest.raises(ClientNotReading, match="left 51 replies unread.*KVGATE_MAX_UNREAD_REPLIES"):
            async for _ in handle.replies(keepalive_s=5):
                pass
        await _until(lambda: any(c["request_id"] == "cmpl-slow" for c in cancels))
        assert [c["reason"] for c in cancels if c["request_id"] == "cmpl-slow"] == ["client_not_reading"]
    finally:
        listener.cancel()
        await dispatcher.stop()


async def test_past_the_bound_in_all_the_request_with_most_unread_ends(aredis):
    dispatcher = await _started(aredis, Unread(per_request=1000, in_all=100))
    try:
        queues = {rid: await dispatcher.enqueue(STREAM, wire_entry(rid, dispatcher.channel), True, None)
                  for rid in ("cmpl-most", "cmpl-some", "cmpl-reads")}
        await _publish(aredis, dispatcher, "cmpl-most", range(1, 61))
        await _publish(aredis, dispatcher, "cmpl-some", range(1, 31))
        reader = Handle(dispatcher, "cmpl-reads", queues["cmpl-reads"], time.time() + 60)
        read = reader.replies(keepalive_s=5)
        for seq in range(1, 21):  # a client that reads: its replies never wait long
            await _publish(aredis, dispatcher, "cmpl-reads", range(seq, seq + 1))
            assert (await asyncio.wait_for(anext(read), 5)).seq == seq
        await _until(lambda: dispatcher.unread.count == 90)
        await _publish(aredis, dispatcher, "cmpl-some", range(31, 42))  # 101 unread in all
        await _until(lambda: "cmpl-most" not in dispatcher.queues)
        assert set(dispatcher.queues) == {"cmpl-some", "cmpl-reads"}
        assert queues["cmpl-some"].qsize() == 41 and dispatcher.unread.count == 41
        dispatcher.release("cmpl-some")  # a request let go is no longer counted
        assert dispatcher.unread.count == 0
    finally:
        await dispatcher.stop()
