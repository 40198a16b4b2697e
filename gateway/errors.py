"""Every error the gateway returns, in OpenAI's shape, mapped from shared.errors in one place."""
from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.errors import KvgateError, Overloaded, Unprocessable, UnsupportedMediaType
from shared.redis_errors import REDIS_ERRORS, refusal

log = logging.getLogger("kvgate.gateway")


def error_response(exc: KvgateError) -> JSONResponse:
    """The one way an error leaves the gateway: OpenAI's body, its status, its headers."""
    headers = dict(exc.headers)
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return JSONResponse(exc.to_openai(), status_code=exc.status, headers=headers)


class _Refused(KvgateError):
    """An error the gateway did not raise itself (FastAPI's validation, Starlette's 404 and 405):
    its own status, and a type and code said per instance."""

    def __init__(self, message: str, status: int, type_: str, code: str | None, *,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message, param=param, headers=headers)
        self.status, self.type, self.code = status, type_, code


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_tag(part) -> bool:
    """pydantic's name for a union's branch (`list[...]`, `constrained-str`), not a field's."""
    return isinstance(part, str) and ("[" in part or part in _UNION_TAGS or part.startswith("constrained-"))


def _path(loc: tuple) -> tuple:
    if loc and loc[0] in ("body", "query", "path", "header", "cookie"):
        loc = loc[1:]
    return tuple(str(p) for p in loc if not _is_tag(p))


def _param(loc: tuple) -> str | None:
    """`messages.0.content.0.text`: the body's path (or the query parameter's name), without
    where FastAPI found it and without pydantic's union-branch tags."""
    return ".".join(_path(loc)) or None


def _most_telling(errors: list[dict]) -> dict:
    """Of a union's errors (one per branch), the one about what the client meant: the deepest,
    and of equally deep ones a broken bound (`too_long`) before a branch's type that did not match
    (`input` with 10,001 items is too long a list, not "a valid string")."""
    def rank(e: dict) -> tuple[int, bool]:
        return len(_path(tuple(e.get("loc", ())))), not str(e.get("type", "")).endswith("_type")
    return max(errors, key=rank, default={"loc": (), "msg": "invalid request"})


def is_json_media(content_type: str | None) -> bool:
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    return kind == "application/json" or kind.endswith("+json")


def _whole_body(error: dict, request: Request) -> KvgateError | None:
    """A refusal of the body as a whole, in words about the body rather than pydantic's."""
    if tuple(error.get("loc", ())) != ("body",):
        return None
    if error.get("type") == "missing":
        return Unprocessable("the request body is empty: send a JSON object")
    if error.get("type") not in ("model_attributes_type", "model_type", "dict_type"):
        return None
    media = request.headers.get("content-type")
    if not is_json_media(media):
        sent = f"it was {media!r}" if media else "none was sent"
        return UnsupportedMediaType(f"the request body must be JSON: send Content-Type: application/json ({sent})")
    return Unprocessable("the request body must be a JSON object")


async def _on_kvgate(_: Request, exc: KvgateError) -> JSONResponse:
    return error_response(exc)


def invalid_json_body(detail: str | None = None) -> JSONResponse:
    message = "request body is not valid JSON" + (f": {detail}" if detail else "")
    return error_response(Unprocessable(message))


async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        return invalid_json_body((errors[0].get("ctx") or {}).get("error"))
    first = _most_telling(errors)
    if (refused := _whole_body(first, request)) is not None:
        return error_response(refused)
    param = _param(tuple(first.get("loc", ())))
    msg = str(first.get("msg")).removeprefix("Value error, ")
    message = f"{param}: {msg}" if param else msg
    return error_response(Unprocessable(message, param=param))


async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = {401: "authentication_error", 403: "permission_error"}.get(exc.status_code,
                                                                      "invalid_request_error")
    message = str(exc.detail)
    if exc.status_code in (404, 405) and message in ("Not Found", "Method Not Allowed"):  # the router's
        path = request.url.path if len(request.url.path) <= 200 else request.url.path[:200] + "..."
        message = (f"Invalid URL ({request.method} {path})" if exc.status_code == 404 else
                   f"Method {request.method} is not allowed on {path}")
    return error_response(_Refused(message, exc.status_code, kind, None, headers=getattr(exc, "headers", None)))


def redis_unavailable(exc: BaseException) -> Overloaded:
    """The 503 for a Redis that refuses (full, read-only, not saving, loading, away): it says why."""
    why = refusal(exc) or "The queue (Redis) is unavailable"
    return Overloaded(f"{why}; retry shortly", retry_after=1)


async def _on_redis(_: Request, exc: Exception) -> JSONResponse:
    return redis_error_response(exc)


def redis_error_response(exc: Exception) -> JSONResponse:
    if refusal(exc) is None:  # not a refusal that passes: a bug or a broken key; say it loudly
        log.error("redis error: %s: %s", type(exc).__name__, exc)
    else:
        log.warning("redis unavailable: %s", refusal(exc))
    return error_response(redis_unavailable(exc))


async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error: %s", type(exc).__name__)
    return error_response(KvgateError("internal error", code="internal_error"))


def install(app: FastAPI) -> None:
    app.add_exception_handler(KvgateError, _on_kvgate)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    for kind in REDIS_ERRORS:  # a cluster client's own errors are no RedisError
        app.add_exception_handler(kind, _on_redis)
    app.add_exception_handler(Exception, _on_unexpected)
