"""A request's replies leave its queue as they came; one already waiting is taken without a turn of
the event loop, yet a long backlog still lets the loop run every TAKEN_IN_A_ROW replies."""
from __future__ import annotations

import asyncio
import time

from gateway.dispatch import KEEPALIVE, TAKEN_IN_A_ROW, Handle, _next_reply
from shared import protocol


def _backlog(n: int) -> asyncio.Queue:
    queue = asyncio.Queue()
    for seq in range(1, n + 1):
        queue.put_nowait(protocol.Delta(request_id="cmpl-1", seq=seq, text="x", token_ids=[7]))
    queue.put_nowait(protocol.Done(request_id="cmpl-1", seq=n + 1, prompt_tokens=3, completion_tokens=n))
    return queue


async def test_a_backlog_comes_out_in_order_and_the_loop_runs_every_so_often_not_every_reply():
    n = 200
    handle = Handle(None, "cmpl-1", _backlog(n), deadline=time.time() + 60)
    turns = 0

    async def ticker():
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    ticking = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    turns = 0
    seen = [reply.seq async for reply in handle.replies(keepalive_s=5)]
    ticking.cancel()
    assert seen == list(range(1, n + 2)) and handle.done and handle.tokens == n
    # the loop ran during the backlog (a stream never holds it for long) ...
    assert turns >= (n + 1) // TAKEN_IN_A_ROW
    # ... but not once per reply, as when each get waited in a task of its own
    assert turns <= (n + 1) // TAKEN_IN_A_ROW + 2


async def test_silence_is_a_keepalive_after_the_wait_and_a_reply_that_comes_meanwhile_is_taken():
    queue = asyncio.Queue()
    started = time.monotonic()
    assert await _next_reply(queue, 0.05, 0) is KEEPALIVE
    assert time.monotonic() - started >= 0.04
    reply = protocol.Delta(request_id="cmpl-1", seq=1)
    asyncio.get_running_loop().call_later(0.01, queue.put_nowait, reply)
    assert await _next_reply(queue, 5, 0) is reply
    assert queue.empty()
