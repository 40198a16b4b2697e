"""Every error the gateway returns, in OpenAI's shape, mapped from shared.errors in one place."""
from __future__ import annotations

import logging
import math

import redis

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.errors import KvgateError, Overloaded
from shared.redis_errors import refusal

log = logging.getLogger("kvgate.gateway")


def error_response(exc: KvgateError) -> JSONResponse:
    headers = dict(getattr(exc, "headers", None) or {})
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return JSONResponse(exc.to_openai(), status_code=exc.status, headers=headers)


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _param(loc: tuple) -> str | None:
    """`messages.0.content.0.text`: the body's path (or the query parameter's name), without
    where FastAPI found it and without pydantic's union-branch tags."""
    if loc and loc[0] in ("body", "query", "path", "header", "cookie"):
        loc = loc[1:]
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS))]
    return ".".join(parts) or None


async def _on_kvgate(_: Request, exc: KvgateError) -> JSONResponse:
    return error_response(exc)


def invalid_json_body(detail: str | None = None) -> JSONResponse:
    message = "request body is not valid JSON" + (f": {detail}" if detail else "")
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": "invalid_value"}}
    return JSONResponse(body, status_code=422)


async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        return invalid_json_body((errors[0].get("ctx") or {}).get("error"))
    # a union reports every branch; the deepest error is the one about what the client meant
    first = max(errors, key=lambda e: len(e.get("loc", ())), default={"loc": (), "msg": "invalid request"})
    param = _param(tuple(first.get("loc", ())))
    msg = str(first.get("msg")).removeprefix("Value error, ")
    message = f"{param}: {msg}" if param else msg
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param,
                      "code": "invalid_value"}}
    return JSONResponse(body, status_code=422)


async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
            405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
    body = {"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}}
    return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))


def redis_unavailable(exc: BaseException) -> Overloaded:
    """The 503 for a Redis that refuses (full, read-only, not saving, loading, away): it says why."""
    why = refusal(exc) or "The queue (Redis) is unavailable"
    return Overloaded(f"{why}; retry shortly", retry_after=1)


async def _on_redis(_: Request, exc: Exception) -> JSONResponse:
    if refusal(exc) is None:  # not a refusal that passes: a bug or a broken key; say it loudly
        log.error("redis error: %s: %s", type(exc).__name__, exc)
    else:
        log.warning("redis unavailable: %s", refusal(exc))
    return error_response(redis_unavailable(exc))


async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error: %s", type(exc).__name__)
    body = {"error": {"message": "internal error", "type": "server_error", "param": None,
                      "code": "internal_error"}}
    return JSONResponse(body, status_code=500)


def install(app: FastAPI) -> None:
    app.add_exception_handler(KvgateError, _on_kvgate)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(redis.RedisError, _on_redis)
    app.add_exception_handler(Exception, _on_unexpected)
