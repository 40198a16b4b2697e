"""The gate on a key's requests waiting on a stream (gateway/queue_gate.py), on its own: a pure
asyncio object, no Redis. The stack-level effect is in tests/integration/test_queue_gate.py."""
from __future__ import annotations

import asyncio

import pytest

from gateway.queue_gate import QueueGate
from shared.errors import Overloaded, RequestTimeout


def _late() -> Exception:
    return RequestTimeout("no place on the stream in time")


def test_a_key_waits_for_its_place_in_arrival_order_and_other_keys_do_not():
    async def scenario():
        gate, got = QueueGate(per_key=2, max_waiting=100), []
        held = [await gate.enter("a", "s", "demo", 5, _late) for _ in range(2)]

        async def third(name: str):
            release = await gate.enter("a", "s", "demo", 5, _late)
            got.append(name)
            return release

        waiters = [asyncio.create_task(third(n)) for n in ("a3", "a4")]
        other_key = await asyncio.wait_for(gate.enter("b", "s", "demo", 5, _late), 1)  # not behind A
        other_stream = await asyncio.wait_for(gate.enter("a", "t", "demo", 5, _late), 1)
        await asyncio.sleep(0.05)
        assert got == [] and gate.waiting() == 2
        held[0]()
        held[0]()  # a second call gives back nothing more
        await asyncio.sleep(0.05)
        assert got == ["a3"]
        held[1]()
        rest = await asyncio.gather(*waiters)
        assert got == ["a3", "a4"] and gate.waiting() == 0
        for release in [*rest, other_key, other_stream]:
            release()
        assert gate._lines == {}  # nothing kept for keys with nothing queued

    asyncio.run(scenario())


def test_a_wait_past_its_limit_raises_the_callers_error_and_leaves_no_trace():
    async def scenario():
        gate = QueueGate(per_key=1, max_waiting=100)
        release = await gate.enter("a", "s", "demo", 5, _late)
        with pytest.raises(RequestTimeout, match="in time"):
            await gate.enter("a", "s", "demo", 0.05, _late)
        cancelled = asyncio.create_task(gate.enter("a", "s", "demo", 5, _late))
        await asyncio.sleep(0.02)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert gate.waiting() == 0
        release()
        assert gate._lines == {}
        again = await asyncio.wait_for(gate.enter("a", "s", "demo", 5, _late), 1)  # the place is free
        again()

    asyncio.run(scenario())


def test_waiting_is_bounded_by_the_stream_depth():
    async def scenario():
        gate = QueueGate(per_key=1, max_waiting=2)
        release = await gate.enter("a", "s", "demo", 5, _late)
        waiters = [asyncio.create_task(gate.enter("a", "s", "demo", 5, _late)) for _ in range(2)]
        await asyncio.sleep(0.02)
        with pytest.raises(Overloaded, match="KVGATE_MAX_STREAM_DEPTH") as refused:
            await gate.enter("a", "s", "demo", 5, _late)
        assert refused.value.retry_after and "'demo'" in str(refused.value)
        release()
        for waiter in waiters:
            (await waiter)()

    asyncio.run(scenario())


def test_no_gate_when_switched_off_or_for_requests_without_a_key():
    async def scenario():
        off = QueueGate(per_key=0, max_waiting=1)
        for _ in range(5):
            await asyncio.wait_for(off.enter("a", "s", "demo", 5, _late), 1)
        on = QueueGate(per_key=1, max_waiting=1)
        for _ in range(5):
            await asyncio.wait_for(on.enter(None, "s", "demo", 5, _late), 1)
        assert off._lines == {} and on._lines == {}

    asyncio.run(scenario())


def test_waiters_go_on_in_priority_order_then_arrival():
    async def scenario():
        gate, got = QueueGate(per_key=1, max_waiting=100), []
        release = await gate.enter("a", "s", "demo", 5, _late)

        async def wait(name: str, priority: int):
            gone = await gate.enter("a", "s", "demo", 5, _late, priority)
            got.append(name)
            gone()

        tasks = []
        for name, priority in (("bulk1", 1), ("bulk2", 1), ("urgent", 0), ("bulk3", 1)):
            tasks.append(asyncio.create_task(wait(name, priority)))
            await asyncio.sleep(0.01)
        release()
        await asyncio.gather(*tasks)
        assert got == ["urgent", "bulk1", "bulk2", "bulk3"]

    asyncio.run(scenario())
