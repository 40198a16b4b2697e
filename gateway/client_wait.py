"""Waiting on a request's replies while its client may leave: the first reply of a stream before its
200 goes out (admitted by the worker, or KVGATE_ADMISSION_WAIT_S passed), and a whole answer that is
dropped, and its request cancelled, the moment its client has gone. Every API's routes wait this way
(gateway/openai_api.py for chat and completions, gateway/answer_io.py for Responses and Messages)."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import Request

from gateway.dispatch import Lookahead
from gateway.routing import VERSION_HEADER
from shared.errors import KvgateError

if TYPE_CHECKING:
    from gateway.openai_api import Answer

DISCONNECT_POLL_S = 1.0  # how often a non-streamed request checks that its client is still there


async def first_reply(request: Request, answer: Answer, wait_s: float) -> Lookahead | None:
    """The replies with the first one in hand, once the worker admitted the request or `wait_s`
    passed; None when the client left first. A refusal before then raises (an HTTP error with its
    status, even for `stream: true`). Either way what did not start is cancelled."""
    ahead, gone, here = Lookahead(answer.replies), asyncio.ensure_future(_disconnect(request)), False
    try:
        here = await ahead.wait_first(wait_s, gone)
    except KvgateError as exc:
        raise exc.with_headers(named(answer))
    finally:
        gone.cancel()
        if not here:  # refused, or the client left: the close cancels what may still run
            ahead.cancel()
            answer.handle.close("not_started")
    return ahead if here else None


async def unless_gone(request: Request, work) -> Any:
    """The result of `work`, or None as soon as the client has gone: a non-streamed request is
    cancelled when its client leaves, as a streamed one is (a batch's cancel relies on it)."""
    task = asyncio.ensure_future(work)
    try:
        while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                return None
        return task.result()
    finally:
        task.cancel()


def named(answer: Answer) -> dict[str, str]:
    """The answer's headers, naming the version that serves it now: a retry before the first
    token may have moved it (gateway/retry.py)."""
    version = answer.handle.version
    if version is not None:
        answer.headers[VERSION_HEADER] = version
    return answer.headers


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone: its body is read, so that is all it can still say."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
