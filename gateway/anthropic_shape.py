"""On Anthropic's routes (/v1/messages...), what leaves the gateway speaks Anthropic: an error body
`{"type": "error", "error": {"type", "message"}}` with Anthropic's status (529 where kvgate says 503,
400 for a body it cannot read), and the rate-limit headers in Anthropic's names besides kvgate's.
A middleware, so every layer's refusal (key, limits, body size, validation, the route) is
rewritten the same way from the one OpenAI-shaped error each of them makes (gateway/errors.py)."""
from __future__ import annotations

import re
import time
from datetime import datetime, timezone

import orjson

PREFIX = "/v1/messages"
# Anthropic's error types by status; kvgate's 503 (overloaded, Redis away, upgrade) is its 529
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          500: "api_error", 504: "timeout_error", 529: "overloaded_error"}
_STATUS = {422: 400, 503: 529}
_HEADERS = {"requests": ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                         "x-ratelimit-reset-requests"),
            "tokens": ("x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens",
                       "x-ratelimit-reset-tokens")}
_DURATION = re.compile(r"^(?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?$")


def status(kvgate_status: int) -> int:
    return _STATUS.get(kvgate_status, kvgate_status)


def error_body(kvgate_status: int, message: str) -> dict:
    kind = _TYPES.get(status(kvgate_status), "api_error" if kvgate_status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def ratelimit_headers(headers: dict[str, str], now: float | None = None) -> dict[str, str]:
    """anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset} from kvgate's x-ratelimit-*
    (the reset as an RFC 3339 time, as Anthropic writes it)."""
    now = time.time() if now is None else now
    out = {}
    for kind, (limit, remaining, reset) in _HEADERS.items():
        if limit in headers:
            out[f"anthropic-ratelimit-{kind}-limit"] = headers[limit]
        if remaining in headers:
            out[f"anthropic-ratelimit-{kind}-remaining"] = headers[remaining]
        if (seconds := _seconds(headers.get(reset, ""))) is not None:
            when = datetime.fromtimestamp(now + seconds, timezone.utc).replace(microsecond=0)
            out[f"anthropic-ratelimit-{kind}-reset"] = when.isoformat().replace("+00:00", "Z")
    return out


def _seconds(duration: str) -> float | None:
    """OpenAI's reset durations ('6m0s', '17s', '20ms'), as gateway/limits.py writes them."""
    match = _DURATION.match(duration) if duration else None
    if not match:
        return None
    minutes, seconds, millis = (int(g) if g else 0 for g in match.groups())
    return minutes * 60 + seconds + millis / 1000


class AnthropicShape:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
            return await self.app(scope, receive, send)
        start: dict | None = None

        async def shaped(message):
            nonlocal start
            if message["type"] == "http.response.start":
                headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in message["headers"]}
                extra = ratelimit_headers(headers)
                if "x-request-id" in headers:
                    extra["request-id"] = headers["x-request-id"]
                message = {**message, "headers": [*message["headers"],
                                                  *((k.encode(), v.encode()) for k, v in extra.items())]}
                if message["status"] >= 400 and headers.get("content-type", "").startswith("application/json"):
                    start = message  # held until its body, which is rewritten
                    return
            elif message["type"] == "http.response.body" and start is not None:
                return await _rewrite(send, start, message)
            await send(message)

        await self.app(scope, receive, shaped)


async def _rewrite(send, start: dict, message: dict) -> None:
    """An error body (JSON, sent whole by JSONResponse) in Anthropic's shape and status."""
    try:
        error = orjson.loads(message.get("body", b""))["error"]
        body = orjson.dumps(error_body(start["status"], error["message"]))
    except (orjson.JSONDecodeError, KeyError, TypeError):
        body = message.get("body", b"")
    headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({**start, "status": status(start["status"]), "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
