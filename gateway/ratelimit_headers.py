"""Puts the x-ratelimit-* headers that admission worked out on the response, whatever made it
(a route's own JSONResponse, a stream, an error handler)."""
from __future__ import annotations


class RateLimitHeaders:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                extra = scope.get("state", {}).get("ratelimit_headers")
                if extra:
                    present = {name.lower() for name, _ in message.get("headers", [])}
                    message["headers"] = [*message.get("headers", []),
                                          *((k.encode(), v.encode()) for k, v in extra.items()
                                            if k.encode() not in present)]
            await send(message)

        await self.app(scope, receive, send_with_headers)
