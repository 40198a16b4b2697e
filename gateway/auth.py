"""Who is calling: the bearer key, looked up by its HMAC digest (or one of the settings' bootstrap keys)."""
from __future__ import annotations

import hmac

from fastapi import Depends, Request

from gateway.keys import KeyRecord, bootstrap_record
from shared.errors import AuthenticationFailed, PermissionDenied
from shared.telemetry import traced


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _bootstrap(settings, token: str) -> KeyRecord | None:
    """The dev key and the admin key from settings, compared in constant time."""
    for secret, key_id, role in ((settings.admin_key, "admin", "admin"), (settings.api_key, "dev", "user")):
        if secret is not None and hmac.compare_digest(token.encode(), secret.get_secret_value().encode()):
            return bootstrap_record(key_id, role)
    return None


@traced("auth")
async def authenticate(request: Request) -> KeyRecord:
    """The caller's key record, or 401 (missing, unknown, revoked or expired key)."""
    token = bearer_token(request)
    if token is None:
        raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>'")
    state = request.app.state
    record = _bootstrap(state.settings, token) or await state.keystore.lookup(token)
    if record is None:
        raise AuthenticationFailed("Incorrect API key provided")
    if (why := record.refusal()) is not None:
        raise AuthenticationFailed(why, code="key_revoked" if record.status == "revoked" else "key_expired")
    request.state.key = record
    return record


async def require_admin(key: KeyRecord = Depends(authenticate)) -> KeyRecord:
    """/admin is for admin keys only: the settings' admin key or a record with role admin."""
    if key.role != "admin":
        raise PermissionDenied("This route needs an admin key", code="admin_key_required")
    return key
