"""Logging for every kvgate process: one JSON object per line, with the request id (from a context
variable) on every line logged while a request is being handled, and the trace id when a span is
current. Lines say what happened to a request, never what it said: no prompt text, no secrets.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import time
from collections.abc import Iterator

import orjson

_request: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("kvgate_request",
                                                                            default=None)
# fields of a LogRecord that are not extras a caller passed
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}
_NOISY = ("httpx", "httpcore", "urllib3", "asyncio", "multipart", "filelock")


def bind_request(request_id: str) -> list[str]:
    """Tag every line logged from this context on with `request_id`. Returns the holder, shared by
    the tasks this context spawns, so `rename_request` reaches lines they log too."""
    holder = [request_id]
    _request.set(holder)
    return holder


def rename_request(request_id: str) -> None:
    """The request now has its final id (the one the client sees): lines from here on carry it."""
    holder = _request.get()
    if holder is not None:
        holder[0] = request_id
    else:
        bind_request(request_id)


def unbind_request() -> None:
    _request.set(None)


def current_request() -> str | None:
    holder = _request.get()
    return holder[0] if holder else None


@contextlib.contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Lines logged inside the block carry `request_id` (the worker handles many requests in one
    thread, so it binds one around each piece of work)."""
    token = _request.set([request_id])
    try:
        yield
    finally:
        _request.reset(token)


def _trace_id() -> str | None:
    try:
        from opentelemetry import trace
    except ImportError:  # pragma: no cover
        return None
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


class JsonFormatter(logging.Formatter):
    def __init__(self, process: str):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
               + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "process": self.process,
               "pid": record.process, "msg": record.getMessage()}
        request_id = getattr(record, "request_id", None) or current_request()
        if request_id:
            out["request_id"] = request_id
        if trace_id := _trace_id():
            out["trace_id"] = trace_id
        for key, value in record.__dict__.items():  # extras: log.info("...", extra={...})
            if key not in _STANDARD and key != "request_id" and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


def setup(level: str | int = "INFO", process: str | None = None) -> None:
    """JSON lines on stderr for the whole process (replaces any handler already on the root)."""
    process = process or os.path.basename(sys.argv[0] or "kvgate")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(process))
    handler.kvgate = True
    root = logging.getLogger()
    for old in list(root.handlers):  # ours from an earlier call, or basicConfig's plain text
        if getattr(old, "kvgate", False) or type(old) is logging.StreamHandler:
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    for name in _NOISY:  # their INFO lines name URLs and connections, not requests
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.captureWarnings(True)
