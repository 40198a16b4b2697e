"""JSON request bodies are read strictly, before any route sees them: a lone UTF-16 surrogate
("\\ud800"), NaN or Infinity, or a number beyond a double's range is a 422 in OpenAI's shape here,
instead of a string no JSON encoder can write back (a 500 at the XADD) or a float nobody meant.
orjson is that strict parser (and integers beyond 64 bits come out of it as floats, which the
schemas' integer bounds then refuse).

The value parsed here is the one the route validates (`ParsedJSONRoute`): FastAPI would otherwise
parse the body a second time with the stdlib's json, ~9 ms a MiB of the event loop."""
from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request
from fastapi.routing import APIRoute

from gateway.errors import error_response, invalid_json_body, is_json_media
from shared.errors import UnsupportedMediaType

PARSED = "kvgate.json"  # the scope's key for the parsed body


def _header(scope, wanted: bytes) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == wanted:
            return value.decode("latin-1")
    return None


def _encoded(scope) -> UnsupportedMediaType | None:
    """A compressed body is refused by name (no route reads one), not misread as broken JSON."""
    coding = _header(scope, b"content-encoding")
    if coding is None or coding.strip().lower() in ("", "identity"):
        return None
    return UnsupportedMediaType(f"Content-Encoding {coding.strip()!r} is not supported: send the body uncompressed")


def _not_json(body: bytes, exc: orjson.JSONDecodeError) -> str:
    """orjson says "surrogates not allowed" of any bytes that are not UTF-8; say where they are."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as bad:
        return f"it is not UTF-8 (byte 0x{body[bad.start]:02x} at offset {bad.start})"
    return str(exc)


class StrictJSONMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        if (refused := _encoded(scope)) is not None:
            return await error_response(refused)(scope, receive, send)
        if not is_json_media(_header(scope, b"content-type")):
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:  # the body limit (outside this middleware) has bounded it already
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        if body:
            try:
                scope[PARSED] = orjson.loads(body)
            except orjson.JSONDecodeError as exc:
                return await invalid_json_body(_not_json(body, exc))(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class _ParsedRequest(Request):
    async def json(self) -> Any:
        return self.scope[PARSED] if PARSED in self.scope else await super().json()


class ParsedJSONRoute(APIRoute):
    """A route that validates the body StrictJSONMiddleware parsed."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def parsed(request: Request):
            return await handler(_ParsedRequest(request.scope, request.receive))
        return parsed
