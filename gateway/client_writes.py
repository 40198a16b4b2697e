"""A client that stops reading its response is let go after KVGATE_CLIENT_WRITE_TIMEOUT_S.

uvicorn writes whatever a response sends into the connection's buffer, however large, and waits
before the next send for as long as the client takes to read: forever, for one that never does.
So a non-streamed answer of 16 choices × 2,000 tokens with logprobs (~23 MB) sat in the gateway
for as long as its client held the connection open unread, and a stream waited on forever kept its
request's slot and state. Here a body goes out in pieces of PIECE bytes, each of which the client
must take within the timeout; one it does not take ends the response (the stream's request is
cancelled on its worker as for a client that left), so what a stalled client holds is a piece or
two in the connection's buffer. Outermost middleware: the pieces are what uvicorn writes.
"""
from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("kvgate.gateway")
PIECE = 1 << 16  # asyncio's write buffer pauses the writer above 64 KiB


class ClientStalled(Exception):
    """The client took no piece of its response within the write timeout."""


class WriteDeadline:
    def __init__(self, app, timeout_s: float):
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def in_pieces(message):
            body = message.get("body", b"") if message["type"] == "http.response.body" else b""
            if len(body) <= PIECE:
                return await self._within(send, message)
            more = message.get("more_body", False)
            for start in range(0, len(body), PIECE):
                await self._within(send, {"type": "http.response.body", "body": body[start:start + PIECE],
                                          "more_body": more or start + PIECE < len(body)})

        try:
            await self.app(scope, receive, in_pieces)
        except ClientStalled:  # the response has started: nothing to answer, the connection closes
            log.info("%s %s: the client read nothing for %.0f s; let go", scope["method"],
                     scope["path"], self.timeout_s)

    async def _within(self, send, message) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                await send(message)
        except TimeoutError:
            raise ClientStalled() from None
