"""Bearer-key authentication for every /v1 route (one key from settings until governance lands)."""
from __future__ import annotations

import hmac

from fastapi import Request

from shared.errors import AuthenticationFailed


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


async def require_key(request: Request) -> None:
    token = bearer_token(request)
    if token is None:
        raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>'")
    expected = request.app.state.settings.api_key or ""
    if not expected or not hmac.compare_digest(token.encode(), expected.encode()):
        raise AuthenticationFailed("Incorrect API key provided")
