"""gateway/client_writes.py as ASGI: a body goes out in pieces of at most 64 KiB; a client that
takes no piece within the timeout is let go (the app's request cancelled, its clean-up run); one
that reads slowly but steadily is not, however long the whole response takes."""
from __future__ import annotations

import asyncio
import time

import pytest

from gateway import client_writes
from gateway.client_writes import PIECE, WriteDeadline

SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions"}


def _app(body: bytes, sends: int = 1, cleaned: list | None = None):
    async def app(scope, receive, send):
        try:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for i in range(sends):
                await send({"type": "http.response.body", "body": body, "more_body": i < sends - 1})
        finally:
            if cleaned is not None:
                cleaned.append(True)
    return app


async def _nothing():
    return {"type": "http.disconnect"}


async def test_a_large_body_goes_out_in_pieces_that_make_it_whole():
    body = bytes(range(256)) * (PIECE * 3 // 256 + 7)
    sent = []

    async def send(message):
        sent.append(message)
    await WriteDeadline(_app(body), timeout_s=5)(SCOPE, _nothing, send)
    pieces = [m for m in sent if m["type"] == "http.response.body"]
    assert len(pieces) == 4 and all(len(p["body"]) <= PIECE for p in pieces)
    assert b"".join(p["body"] for p in pieces) == body
    assert [p["more_body"] for p in pieces] == [True, True, True, False]


async def test_a_client_that_takes_nothing_is_let_go(monkeypatch):
    monkeypatch.setattr(client_writes, "WATCH_S", 0.05)
    cleaned: list = []
    never = asyncio.Event()

    async def send(message):
        if message["type"] == "http.response.body":
            await never.wait()  # a paused transport whose client never reads
    started = time.monotonic()
    call = asyncio.ensure_future(WriteDeadline(_app(b"x" * 10, cleaned=cleaned), timeout_s=0.3)(
        SCOPE, _nothing, send))
    await asyncio.wait_for(asyncio.shield(call), timeout=5)  # returns: the cancel is not raised on
    assert 0.3 <= time.monotonic() - started < 2 and cleaned == [True]
    assert call.cancelling() == 0  # the cancel was the deadline's own, and taken back


async def test_a_slow_steady_reader_is_served_in_full(monkeypatch):
    monkeypatch.setattr(client_writes, "WATCH_S", 0.05)
    taken = []

    async def send(message):
        await asyncio.sleep(0.1)  # each piece within the timeout, all of them well past it
        taken.append(message)
    await WriteDeadline(_app(b"y" * 100, sends=12), timeout_s=0.3)(SCOPE, _nothing, send)
    assert len(taken) == 13 and taken[-1]["more_body"] is False


async def test_a_cancel_from_elsewhere_still_cancels():
    async def send(message):
        await asyncio.sleep(10)
    call = asyncio.ensure_future(WriteDeadline(_app(b"z"), timeout_s=60)(SCOPE, _nothing, send))
    await asyncio.sleep(0.05)
    call.cancel()  # the client left, or the server stops: not the write deadline's to swallow
    with pytest.raises(asyncio.CancelledError):
        await call
