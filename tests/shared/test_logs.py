"""JSON log lines: one object per line, the bound request id on each, extras as fields."""
from __future__ import annotations

import asyncio
import io
import json
import logging

from shared import logs


def _capture() -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter("test"))
    logger = logging.getLogger("kvgate.test.logs")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, out


def _lines(out: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_lines_carry_the_request_id_bound_in_their_context_and_its_final_name():
    log, out = _capture()

    async def request() -> None:
        logs.bind_request("req-1")
        log.info("admitted")
        async def body() -> None:  # a task the request spawns (the SSE body) sees the rename
            await asyncio.sleep(0)
            log.info("streaming", extra={"tokens": 3})
        task = asyncio.create_task(body())
        logs.rename_request("chatcmpl-1")
        await task

    asyncio.run(request())
    log.info("no request here")
    first, second, third = _lines(out)
    assert (first["msg"], first["request_id"], first["process"]) == ("admitted", "req-1", "test")
    assert (second["request_id"], second["tokens"]) == ("chatcmpl-1", 3)
    assert "request_id" not in third


def test_request_context_scopes_the_id_and_errors_stay_one_line():
    log, out = _capture()
    with logs.request_context("cmpl-9"):
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
    log.warning("after")
    failed, after = _lines(out)
    assert failed["request_id"] == "cmpl-9" and "ValueError: boom" in failed["exc"]
    assert failed["level"] == "ERROR" and "request_id" not in after
