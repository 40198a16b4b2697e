"""Refuse bodies over the configured size with 413 before anything parses them."""
from __future__ import annotations

import orjson

from shared.errors import PayloadTooLarge


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int, larger: dict[str, int] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.larger = larger or {}  # path -> its own limit (file uploads)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.larger.get(scope["path"], self.max_bytes)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await self._refuse(send, limit)
        body, more = [], True
        total = 0
        while more:  # buffer (at most max_bytes) so chunked bodies are bounded too
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            total += len(chunk)
            if total > limit:
                return await self._refuse(send, limit)
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

    async def _refuse(self, send, limit: int) -> None:
        exc = PayloadTooLarge(f"Request body exceeds the limit of {limit} bytes")
        payload = orjson.dumps(exc.to_openai())
        await send({"type": "http.response.start", "status": exc.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})
