"""Each HTTP request observed once, from arrival to last byte, as the client sees it: the server
span its trace starts with, a request id every log line of it carries, and its metrics (count by
route, status, model and version; latency; TTFT of streams; open streams) with one access line.
Outermost middleware, so a refusal by any layer under it (body size, key, limits) is counted too.
"""
from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass

from opentelemetry.trace import SpanKind, Status, StatusCode

from gateway import metrics
from shared import logs, telemetry

log = logging.getLogger("kvgate.gateway.access")
UNOBSERVED = {"/metrics", "/healthz", "/readyz"}  # scraped and probed every few seconds
CLIENT_GONE = 499  # nginx's status for a client that closed the connection before the end


@dataclass
class _Response:
    start: float
    status: int | None = None
    streaming: bool = False
    complete: bool = False
    labels: tuple[str, str] = ("", "")


def _lease(scope):
    return scope.get("state", {}).get("lease")


def _model_version(scope) -> tuple[str, str]:
    """Only once routed: a model name a client merely asked for could be anything."""
    lease = _lease(scope)
    if lease is None or lease.version is None:
        return "", ""
    return lease.model, lease.version


class Observe:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in UNOBSERVED:
            return await self.app(scope, receive, send)
        seen = _Response(time.monotonic())
        logs.bind_request("req-" + secrets.token_hex(8))
        with _server_span(scope) as span:

            async def observed_send(message):
                if message["type"] == "http.response.start":
                    seen.status = message["status"]
                    seen.streaming = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                         for k, v in message.get("headers", []))
                    if seen.streaming:
                        seen.labels = _model_version(scope)
                        metrics.STREAMS.labels(*seen.labels).inc()
                elif message["type"] == "http.response.body" and not message.get("more_body"):
                    seen.complete = True
                await send(message)

            try:
                await self.app(scope, receive, observed_send)
            except BaseException:
                seen.status = seen.status or 500
                raise
            finally:
                if seen.streaming:
                    metrics.STREAMS.labels(*seen.labels).dec()
                _record(scope, seen, span)


def _server_span(scope):
    """The request's server span, a client's own trace (`traceparent`) its parent. With tracing
    off, nothing: not even the client's trace context travels on to the worker."""
    if not telemetry.enabled():
        return telemetry.NO_SPAN
    parent = telemetry.extract(_trace_headers(scope))
    attributes = {"http.request.method": scope["method"], "url.path": scope["path"]}
    return telemetry.span(f"{scope['method']} {scope['path']}", context=parent, kind=SpanKind.SERVER,
                          attributes=attributes)


def _trace_headers(scope) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])
            if k in (b"traceparent", b"tracestate")}


def _status(scope, seen: _Response) -> int:
    lease = _lease(scope)
    if lease is not None and lease.error_status is not None:
        return lease.error_status  # a stream that ended with an error event
    if seen.status == 200 and not seen.complete:
        return CLIENT_GONE
    return seen.status or 500


def _record(scope, seen: _Response, span) -> None:
    elapsed = time.monotonic() - seen.start
    route = getattr(scope.get("route"), "path", "unmatched")
    model, version = _model_version(scope)
    status = _status(scope, seen)
    metrics.REQUESTS.labels(route, str(status), model, version).inc()
    metrics.LATENCY.labels(route, model, version).observe(elapsed)
    lease = _lease(scope)
    first = lease.outcome.first if lease is not None and lease.outcome is not None else None
    ttft = None if first is None else first - seen.start
    if seen.streaming and ttft is not None:
        metrics.TTFT.labels(model, version).observe(ttft)
    span.update_name(f"{scope['method']} {route}")
    span.set_attribute("http.response.status_code", status)
    if model:
        span.set_attributes({"kvgate.model": model, "kvgate.version": version})
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR))
    log.info("%s %s %d", scope["method"], route, status, extra={
        "status": status, "model": model or None, "version": version or None,
        "key_id": lease.key.id if lease is not None else None,
        "duration_ms": round(elapsed * 1000, 1),
        "ttft_ms": None if ttft is None else round(ttft * 1000, 1)})
