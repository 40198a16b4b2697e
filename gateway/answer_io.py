"""An `Answer` (gateway/openai_api.py's one request path) read by an API that writes its own shape
(Responses, Messages): whole, once the request is done, or streamed, its 200 sent by the rule chat
follows (once the worker admitted the request, or after KVGATE_ADMISSION_WAIT_S: a refusal before
then is an HTTP error, one after it an error event). Either way the lease is told the usage the
client was told, so the same settlement charges it."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError
from starlette.background import BackgroundTask

from gateway import client_wait, resume
from gateway.admission import Lease
from gateway.dispatch import KEEPALIVE, Lookahead
from gateway.openai_api import SSE_HEADERS, Answer, Call, first_reply_held, json_body, sse_data
from gateway.schemas import ChatCompletionRequest
from gateway.state import GatewayState
from shared import protocol
from shared.errors import InvalidRequest, KvgateError


class Renderer(Protocol):
    """One API's way of writing a request's replies: events while streaming, one body at the end."""

    def start(self) -> list[bytes]: ...

    def delta(self, reply: protocol.Delta) -> list[bytes]: ...

    async def done(self, usage: dict) -> list[bytes]: ...

    def error(self, exc: KvgateError) -> list[bytes]: ...

    def keepalive(self) -> bytes: ...

    def result(self) -> dict[str, Any]: ...

    def spec(self) -> dict[str, Any]: ...  # what rebuilds it at another gateway (JSON)


def chat_request(chat: dict[str, Any], fields: dict[str, str] | None = None) -> ChatCompletionRequest:
    """The chat request another API's body translates to; 400 naming what chat's bounds refuse of
    it (a conversation longer than chat allows, say), never a 500. The error names the caller's
    field (`fields` maps chat's names to the API's: `messages` is `/v1/responses`' `input`), and
    where in the chat request it was found."""
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        if not loc:
            raise InvalidRequest(str(first.get("msg"))) from None
        field = (fields or {}).get(loc[0], loc[0])
        where = "" if loc == [field] else f" (at {'.'.join(loc)} of the chat request it becomes)"
        raise InvalidRequest(f"{field}: {first.get('msg')}{where}", param=field) from None


def usage_of(done: protocol.Done) -> dict:
    """The usage the lease settles, in chat's names (each API renders it in its own)."""
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


async def whole(request: Request, lease: Lease, answer: Answer, render: Renderer) -> Response:
    """`stream: false`: one body once the request is done (499 when the client left first)."""
    try:
        usage = await client_wait.unless_gone(request, _drain(answer.replies, render))
    except KvgateError as exc:
        raise exc.with_headers(client_wait.named(answer))
    finally:
        answer.handle.close("client_gone")
    if usage is None:
        return Response(status_code=499)
    lease.finished(usage)
    await render.done(usage)
    return json_body(render.result(), client_wait.named(answer))


async def _drain(replies: AsyncIterator, render: Renderer) -> dict:
    async for reply in replies:
        if isinstance(reply, protocol.Delta):
            render.delta(reply)
        elif isinstance(reply, protocol.Done):
            return usage_of(reply)
    raise AssertionError("reply stream ended without done")  # pragma: no cover


async def stream(request: Request, state: GatewayState, lease: Lease, answer: Answer, call: Call,
                 api: str, render: Renderer) -> Response:
    """`stream: true`: the events of `render`, the 200 once the worker admitted the request; held
    in Redis like chat's (gateway/openai_api.py `first_reply_held`), with what rebuilds `render`, so that the
    stream resumes at any gateway (Last-Event-ID) and is settled once."""
    ahead = await first_reply_held(request, state, lease, answer, call, {"api": api, "render": render.spec()})
    if ahead is None:
        return Response(status_code=499)
    return StreamingResponse(_events(answer, ahead, lease, render), media_type="text/event-stream",
                             headers={**SSE_HEADERS, **client_wait.named(answer)},
                             background=BackgroundTask(answer.handle.aclose, "client_disconnected"))


def resumed(answer: Answer, lease: Lease, render: Renderer, after: int) -> Response:
    """A stream rebuilt from its reply log (gateway/openai_api.py `_resume`): every reply goes
    through `render`, so its state (sequence numbers, open blocks) is the original's; only the
    events after `after` are sent."""
    return StreamingResponse(_events(answer, answer.replies, lease, render, after),
                             media_type="text/event-stream", headers={**SSE_HEADERS, **answer.headers},
                             background=BackgroundTask(answer.handle.aclose, "client_disconnected"))


async def _events(answer: Answer, replies: Lookahead, lease: Lease, render: Renderer,
                  after: int = -1) -> AsyncIterator[bytes]:
    """Each reply's events written the moment it arrives, in one write, the last of them with the
    id `<request id>:<sequence>` (an event without an id keeps the one before it, so a client cut
    off inside a reply's events resumes with all of them); a disconnect cancels the request (in
    `finally`) unless a resume may come within KVGATE_RESUME_GRACE_S."""
    rid = answer.shape.id  # the id the client knows, whichever attempt serves it
    try:
        opening = render.start()
        if after < 0:
            yield _tagged(opening, rid, 0)
        try:
            async for reply in replies:
                if reply is KEEPALIVE:
                    yield render.keepalive()
                    continue
                if isinstance(reply, protocol.Delta):
                    events = render.delta(reply)
                elif isinstance(reply, protocol.Done):
                    lease.finished(usage_of(reply))
                    events = await render.done(lease.usage)
                else:
                    continue
                if events and reply.seq > after:
                    yield _tagged(events, rid, reply.seq)
                if isinstance(reply, protocol.Done) and (past := resume.past_the_end(after, reply.seq)):
                    yield _tagged(render.error(past), rid, reply.seq)
        except KvgateError as exc:
            lease.failed(exc.status)
            yield _tagged(render.error(exc), rid, answer.handle.last_seq)
    finally:
        replies.cancel()
        answer.handle.close("client_disconnected")


def _tagged(events: list[bytes], request_id: str, seq: int) -> bytes:
    """The events as one write, the last carrying the id of the reply they render."""
    if not events:
        return b""
    return b"".join(events[:-1]) + resume.event_id(request_id, seq) + events[-1]


def sse(event: str, obj: Any) -> bytes:
    """A named server-sent event (both APIs name theirs: `event: <type>`)."""
    return b"event: " + event.encode() + b"\ndata: " + sse_data(obj) + b"\n\n"
