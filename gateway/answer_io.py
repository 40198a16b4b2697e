"""An `Answer` (gateway/openai_api.py's one request path) read by an API that writes its own shape
(Responses, Messages): whole, once the request is done, or streamed, its 200 sent by the rule chat
follows (once the worker admitted the request, or after KVGATE_ADMISSION_WAIT_S: a refusal before
then is an HTTP error, one after it an error event). Either way the lease is told the usage the
client was told, so the same settlement charges it."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.background import BackgroundTask

from gateway.admission import Lease
from gateway.dispatch import KEEPALIVE, Lookahead
from gateway.openai_api import SSE_HEADERS, Answer
from gateway.schemas import ChatCompletionRequest
from shared import protocol
from shared.errors import InvalidRequest, KvgateError

DISCONNECT_POLL_S = 1.0  # how often a non-streamed request checks that its client is still there


class Renderer(Protocol):
    """One API's way of writing a request's replies: events while streaming, one body at the end."""

    def start(self) -> list[bytes]: ...

    def delta(self, reply: protocol.Delta) -> list[bytes]: ...

    async def done(self, usage: dict) -> list[bytes]: ...

    def error(self, exc: KvgateError) -> list[bytes]: ...

    def keepalive(self) -> bytes: ...

    def result(self) -> dict[str, Any]: ...


def chat_request(chat: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request another API's body translates to; 400 naming what chat's bounds refuse of
    it (a conversation longer than chat allows, say), never a 500."""
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise InvalidRequest(f"{where}: {first.get('msg')}", param=where or None) from None


def usage_of(done: protocol.Done) -> dict:
    """The usage the lease settles, in chat's names (each API renders it in its own)."""
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


async def whole(request: Request, lease: Lease, answer: Answer, render: Renderer) -> Response:
    """`stream: false`: one body once the request is done (499 when the client left first)."""
    try:
        usage = await _unless_gone(request, _drain(answer.replies, render))
    except KvgateError as exc:
        raise exc.with_headers(answer.headers)
    finally:
        answer.handle.close("client_gone")
    if usage is None:
        return Response(status_code=499)
    lease.finished(usage)
    await render.done(usage)
    return JSONResponse(render.result(), headers=answer.headers)


async def _drain(replies: AsyncIterator, render: Renderer) -> dict:
    async for reply in replies:
        if isinstance(reply, protocol.Delta):
            render.delta(reply)
        elif isinstance(reply, protocol.Done):
            return usage_of(reply)
    raise AssertionError("reply stream ended without done")  # pragma: no cover


async def stream(request: Request, lease: Lease, answer: Answer, wait_s: float,
                 render: Renderer) -> Response:
    """`stream: true`: the events of `render`, the 200 once the worker admitted the request."""
    ahead, gone, here = Lookahead(answer.replies), asyncio.ensure_future(_disconnect(request)), False
    try:
        here = await ahead.wait_first(wait_s, gone)
    except KvgateError as exc:
        raise exc.with_headers(answer.headers)
    finally:
        gone.cancel()
        if not here:  # refused, or the client left: the close cancels what may still run
            ahead.cancel()
            answer.handle.close("not_started")
    if not here:
        return Response(status_code=499)
    return StreamingResponse(_events(answer, ahead, lease, render), media_type="text/event-stream",
                             headers={**SSE_HEADERS, **answer.headers},
                             background=BackgroundTask(answer.handle.close, "client_disconnected"))


async def _events(answer: Answer, replies: Lookahead, lease: Lease,
                  render: Renderer) -> AsyncIterator[bytes]:
    """Each delta written the moment it arrives; a disconnect cancels the request (in `finally`)."""
    try:
        for event in render.start():
            yield event
        try:
            async for reply in replies:
                if reply is KEEPALIVE:
                    yield render.keepalive()
                elif isinstance(reply, protocol.Delta):
                    for event in render.delta(reply):
                        yield event
                elif isinstance(reply, protocol.Done):
                    lease.finished(usage_of(reply))
                    for event in await render.done(lease.usage):
                        yield event
        except KvgateError as exc:
            lease.failed(exc.status)
            for event in render.error(exc):
                yield event
    finally:
        replies.cancel()
        answer.handle.close("client_disconnected")


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone: its body is read, so that is all it can still say."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, work) -> Any:
    """The result of `work`, or None as soon as the client has gone (the request is cancelled)."""
    task = asyncio.ensure_future(work)
    try:
        while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                return None
        return task.result()
    finally:
        task.cancel()


def sse(event: str, data: bytes) -> bytes:
    """A named server-sent event (both APIs name theirs: `event: <type>`)."""
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"
