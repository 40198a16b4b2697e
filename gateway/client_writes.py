"""A client that stops reading its response is let go after KVGATE_CLIENT_WRITE_TIMEOUT_S.

uvicorn writes whatever a response sends into the connection's buffer, however large, and waits
before the next send for as long as the client takes to read: forever, for one that never does.
So a stream waited on forever kept its request's slot and state, and a large non-streamed answer
its bytes, for as long as the client held the connection open unread. Here a body goes out in
pieces of PIECE bytes, and a request whose send has waited longer than the timeout is cancelled
(as for a client that left: a stream's request is cancelled on its worker) and its connection reset
(gateway/http_protocol.py hands over the transport): a stalled client holds nothing after. One
watcher task looks at the sends in progress every second, so a send costs two attribute writes,
not a timer of its own (an `asyncio.timeout` per send was 3.6 µs, for every token of every
stream). Outermost middleware: the pieces are what uvicorn writes.
"""
from __future__ import annotations

import asyncio
import logging
from contextvars import ContextVar

from gateway.http_protocol import TRANSPORT

log = logging.getLogger("kvgate.gateway")
PIECE = 1 << 16  # asyncio's write buffer pauses the writer above 64 KiB
WATCH_S = 1.0  # how often sends in progress are looked at (at most: a quarter of the timeout)
_LET_GO: ContextVar[bool] = ContextVar("kvgate_let_go", default=False)  # this request's task


class _LetGoIsNoError(logging.Filter):
    """uvicorn logs an ERROR for a response its app left unfinished; a client let go here is logged
    above at INFO, and a client must not fill an operator's error log at will."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_LET_GO.get() and record.getMessage().startswith("ASGI callable returned without"))


logging.getLogger("uvicorn.error").addFilter(_LetGoIsNoError())


class _Request:
    __slots__ = ("task", "since", "stalled")

    def __init__(self, task: asyncio.Task):
        self.task = task
        self.since: float | None = None  # when its send in progress began (the loop's clock)
        self.stalled = False


class WriteDeadline:
    def __init__(self, app, timeout_s: float):
        self.app = app
        self.timeout_s = timeout_s
        self._open: set[_Request] = set()
        self._watcher: asyncio.Task | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        request = _Request(asyncio.current_task())

        async def in_pieces(message):
            body = message.get("body", b"") if message["type"] == "http.response.body" else b""
            pieces = [message] if len(body) <= PIECE else [
                {"type": "http.response.body", "body": body[start:start + PIECE],
                 "more_body": message.get("more_body", False) or start + PIECE < len(body)}
                for start in range(0, len(body), PIECE)]
            for piece in pieces:
                request.since = loop.time()
                await send(piece)
                request.since = None

        self._open.add(request)
        self._watch()
        try:
            await self.app(scope, receive, in_pieces)
        except asyncio.CancelledError:
            if not request.stalled:
                raise
            request.task.uncancel()  # cancelled here, for this: the connection is reset
            _LET_GO.set(True)
            if (transport := scope.get(TRANSPORT)) is not None:
                transport.abort()
            log.info("%s %s: the client read nothing for %.0f s; let go", scope["method"],
                     scope["path"], self.timeout_s)
        finally:
            self._open.discard(request)

    def _watch(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._stalls())

    async def _stalls(self) -> None:
        """Cancels each request whose send has waited past the timeout; ends when none is open."""
        loop = asyncio.get_running_loop()
        while self._open:
            await asyncio.sleep(min(WATCH_S, self.timeout_s / 4))
            now = loop.time()
            for request in list(self._open):
                if request.since is not None and now - request.since > self.timeout_s and not request.stalled:
                    request.stalled = True
                    request.task.cancel()
