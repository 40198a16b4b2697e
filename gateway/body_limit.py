"""Refuse bodies over the configured size with 413 before anything parses them.

JSON bodies (at most KVGATE_MAX_BODY_BYTES, 1 MiB) are read here, under that bound, before routing
and so before the key is checked: what an anonymous client can make a gateway hold is that much per
open connection, as for a keyed one, and the failed-auth throttle turns an address away after its
burst of 401s. Checking the key first would take a second authentication path in a middleware, or
routes without a declared body (and so without the schemas clients and fuzzers read).

Uploads are different: up to KVGATE_MAX_FILE_BYTES, so their routes (`larger`) read their own body
as a stream, after the key is checked, under their own limit; here only the declared length is
checked. What a route answers before reading its body, uvicorn discards as it arrives (the
connection stays usable, so the client reads its answer instead of a reset), never buffering it.

Every body, either way, must keep coming: a client that sends none of it for
KVGATE_CLIENT_READ_TIMEOUT_S gets a 408 and what it sent is dropped. Without that, one that stopped
1 byte short held its bytes and its connection for as long as it liked (a thousand connections,
a GiB); the request's head has its own deadline (gateway/http_protocol.py).
"""
from __future__ import annotations

import asyncio

from gateway.errors import error_response
from shared.errors import ClientTooSlow, PayloadTooLarge


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int, larger: dict[str, int] | None = None,
                 read_timeout_s: float = 30.0):
        self.app = app
        self.max_bytes = max_bytes
        self.larger = larger or {}  # path -> its own limit; its route reads the body as a stream
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        receive = _timed(receive, self.read_timeout_s)
        limit = self.larger.get(scope["path"], self.max_bytes)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await _refuse(scope, receive, send, limit)
        if scope["path"] in self.larger:
            return await self.app(scope, receive, send)
        body, more = [], True
        total = 0
        while more:  # buffer (at most max_bytes) so chunked bodies are bounded too
            try:
                msg = await receive()
            except ClientTooSlow as exc:
                return await error_response(exc)(scope, receive, send)
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            total += len(chunk)
            if total > limit:
                return await _refuse(scope, receive, send, limit)
            body.append(chunk)
            more = msg.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _timed(receive, timeout_s: float):
    """`receive`, each message of the body within `timeout_s` (ClientTooSlow beyond); once the body
    is whole, untimed: what is left to hear is the client leaving, whenever it does."""
    whole = False

    async def timed():
        nonlocal whole
        if whole:
            return await receive()
        try:
            async with asyncio.timeout(timeout_s):
                msg = await receive()
        except TimeoutError:
            raise ClientTooSlow(f"No more of the request body came within {timeout_s:g} s "
                                "(KVGATE_CLIENT_READ_TIMEOUT_S)") from None
        whole = msg["type"] != "http.request" or not msg.get("more_body", False)
        return msg
    return timed


async def _refuse(scope, receive, send, limit: int) -> None:
    exc = PayloadTooLarge(f"Request body exceeds the limit of {limit} bytes")
    await error_response(exc)(scope, receive, send)
