"""Who is calling: the bearer key (or Anthropic's `x-api-key`), looked up by its HMAC digest (or one of
the settings' bootstrap keys)."""
from __future__ import annotations

import functools
import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.routing import APIRoute

from gateway.deps import state_of
from gateway.errors import error_response, redis_error_response
from gateway.keys import BOOTSTRAP, KeyRecord, bootstrap_keys, bootstrap_record
from gateway.state import GatewayState
from shared import names
from shared.batches import token_batch
from shared.errors import AuthenticationFailed, KvgateError, PermissionDenied
from shared.redis_errors import REDIS_ERRORS
from shared.telemetry import traced


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def api_key(request: Request) -> str | None:
    """The key a client sent: `Authorization: Bearer`, or `x-api-key` as Anthropic's clients send it."""
    return bearer_token(request) or request.headers.get("x-api-key", "").strip() or None


def _bootstrap(settings, token: str) -> KeyRecord | None:
    """The dev key and the admin key from settings, compared in constant time."""
    for field, key_id, role in BOOTSTRAP:  # a record is built only for the key that matched
        secret = getattr(settings, field)
        if secret is not None and hmac.compare_digest(token.encode(), secret.get_secret_value().encode()):
            return bootstrap_record(key_id, role)
    return None


async def authenticate(request: Request) -> KeyRecord:
    """The caller's key record, or 401 (missing, unknown, revoked or expired key); an address that
    keeps failing gets 429 for a while (gateway/throttle.py). A request AuthFirst checked before
    its body has the record in its scope already: no second lookup, and no second "auth" span."""
    if (known := request.scope.get(AUTHENTICATED)) is not None:
        request.state.key = known
        return known
    return await _authenticate(request)


@traced("auth")
async def _authenticate(request: Request) -> KeyRecord:
    state = state_of(request)
    state.throttle.check_auth(request)
    try:
        record = await _identify(request, state)
    except AuthenticationFailed:
        state.throttle.auth_failed(request)
        raise
    request.state.key = record
    return record


AUTHENTICATED = "kvgate.key"  # the scope's key for the record AuthFirst found
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
# The routes whose POST takes one request of the key's minute (gateway/admission.py; a resume,
# sent with Last-Event-ID, takes none): those AuthFirst refuses before the body while the key's
# minute is known to be full. The admin API and a batch's cancel count nothing.
COUNTED_POSTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                           "/v1/messages/count_tokens", "/v1/embeddings", "/tokenize", "/detokenize",
                           "/v1/files", "/v1/batches", "/v1/score", "/score", "/v1/rerank", "/rerank",
                           "/v2/rerank"})


class AuthFirst:
    """A request that may carry a body is authenticated before the body is read: every such route
    needs a key, and a body is the dearest thing a stranger can make the gateway parse (~10 ms of the
    event loop for a MiB of JSON, ten times that sent in one-byte chunks). Without it, an address
    past its budget of failed authentications still had each body read and parsed before its 429.
    The record goes in the scope, where `authenticate` finds it again. Likewise a key whose minute
    is known to be full (gateway/limits.py FullMinutes) gets its 429 before its body is read."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS")
                or scope["path"] in PUBLIC_PATHS):
            return await self.app(scope, receive, send)
        request = Request(scope)
        try:
            record = scope[AUTHENTICATED] = await authenticate(request)
            if _counted(scope, request) and (full := state_of(request).limits.known_full(record)):
                raise full
        except KvgateError as exc:
            _route_for(scope)
            return await error_response(exc)(scope, receive, send)
        except REDIS_ERRORS as exc:
            _route_for(scope)
            return await redis_error_response(exc)(scope, receive, send)
        await self.app(scope, receive, send)


def _counted(scope, request: Request) -> bool:
    return (scope["method"] == "POST" and scope["path"] in COUNTED_POSTS
            and "last-event-id" not in request.headers)


def _route_for(scope) -> None:
    """The route a refused request was for, as the router would have found it: the metrics and the
    access log name it by its template (never by a path a client made up)."""
    for route in _api_routes(scope["app"]):
        if scope["method"] in route.methods and route.path_regex.match(scope["path"]):
            scope["route"] = route
            return


@functools.cache
def _api_routes(app) -> tuple[APIRoute, ...]:
    found: list[APIRoute] = []

    def walk(routes) -> None:
        for route in routes:
            if isinstance(route, APIRoute):
                found.append(route)
            elif (included := getattr(route, "original_router", None)) is not None:
                walk(included.routes)  # FastAPI's included router: its routes carry their prefix
    walk(app.router.routes)
    return tuple(found)


async def _identify(request: Request, state: GatewayState) -> KeyRecord:
    token = api_key(request)
    if token is None:
        raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>' (or "
                                   "'x-api-key: <key>')")
    record = (_bootstrap(state.settings, token) or await _batch_owner(request, state, token)
              or await state.keystore.lookup(token))
    if record is None:
        raise AuthenticationFailed("Incorrect API key provided")
    if (why := record.refusal()) is not None:
        raise AuthenticationFailed(why, code="key_revoked" if record.status == "revoked" else "key_expired")
    return record


async def _batch_owner(request: Request, state: GatewayState, token: str) -> KeyRecord | None:
    """A batch line (services/batch.py) carries its batch's token: it stands for the key that made
    the batch, so the line is governed as that key's request, and it goes to the batch lane."""
    batch_id = token_batch(state.settings.secret.get_secret_value(), token)
    if batch_id is None:
        return None
    batch = await state.batches.find(batch_id)
    if batch is None or batch.status != "in_progress":
        raise AuthenticationFailed(f"Batch {batch_id} is not in progress", code="batch_not_running")
    request.state.lane = names.BATCH_LANE
    for secret, record in bootstrap_keys(state.settings):
        if batch.owner == record.id:
            return record if secret is not None else None
    return await state.keystore.by_id(batch.owner)


async def require_admin(request: Request, key: KeyRecord = Depends(authenticate)) -> KeyRecord:
    """/admin is for admin keys only: the settings' admin key or a record with role admin (never a
    batch line's token, whatever key made the batch)."""
    if key.role != "admin" or getattr(request.state, "lane", None) == names.BATCH_LANE:
        raise PermissionDenied("This route needs an admin key", code="admin_key_required")
    return key


CurrentKey = Annotated[KeyRecord, Depends(authenticate)]
