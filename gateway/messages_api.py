"""Anthropic's Messages API: `POST /v1/messages` becomes a chat request on the one request path
(`open_answer`: the same key, limits, routing, checks, reservation, dispatch and usage), rendered as
a message or Anthropic's event stream. Errors and rate-limit headers on these routes are Anthropic's
(gateway/anthropic_shape.py). `count_tokens` is exact: the gateway has no tokenizer, so the prompt
goes to a worker like any request (one token generated), which renders and counts it, and is
charged as such."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Header, Request

from gateway import answer_io, resume
from gateway.admission import Admitted, Lease, admit
from gateway.answer_items import Items
from gateway.deps import StateDep
from gateway.messages_render import MessageRender
from gateway.messages_schemas import CountTokensRequest, MessagesRequest
from gateway.openai_api import Answer, Call, open_answer, resume_request
from gateway.routing import VERSION_HEADER_DOC
from gateway.state import GatewayState
from gateway.strict_json import ParsedJSONRoute
from shared import protocol
from shared.errors import KvgateError


async def _anthropic_version(anthropic_version: str | None = Header(
        None, description="Accepted (any version); the shapes served are 2023-06-01's")) -> None:
    return None


router = APIRouter(prefix="/v1", dependencies=[Depends(admit), Depends(_anthropic_version)],
                   tags=["anthropic"], route_class=ParsedJSONRoute)


@router.post("/messages", openapi_extra=VERSION_HEADER_DOC)
async def create_message(body: MessagesRequest, request: Request, lease: Admitted, state: StateDep):
    if lease.resuming:  # the client lost its stream and asks for the rest (Last-Event-ID)
        return await resume_request(request, state, lease, API)
    body.refuse_unserved()
    call = Call.chat(answer_io.chat_request(body.chat()))
    answer = await open_answer(request, state, lease, call)
    items = Items(answer.shape.output(0), stops=list(body.stop_sequences or ()))
    render = MessageRender("msg_" + answer.handle.request_id.removeprefix("chatcmpl-"), body.model, items)
    if body.stream:
        return await answer_io.stream(request, state, lease, answer, call, API, render)
    return await answer_io.whole(request, lease, answer, render)


async def _resumed(state: GatewayState, lease: Lease, answer: Answer, spec: dict, after: int):
    """A Messages stream rebuilt at this gateway from what its render's spec kept."""
    render = MessageRender(spec["id"], spec["model"], Items(answer.shape.output(0), stops=spec["stops"]))
    return answer_io.resumed(answer, lease, render, after)


API = "messages"
resume.RENDERS[API] = _resumed


@router.post("/messages/count_tokens", openapi_extra=VERSION_HEADER_DOC)
async def count_tokens(body: CountTokensRequest, request: Request, lease: Admitted, state: StateDep):
    """The prompt's tokens as the worker renders them (template, tools, thinking switch included)."""
    as_message = MessagesRequest.model_construct(**dict(body), max_tokens=1, stream=False,
                                                 stop_sequences=None, temperature=0, top_p=None,
                                                 top_k=None)
    chat = answer_io.chat_request({**as_message.chat(), "tool_choice": "none"})  # count; generate nothing forced
    answer = await open_answer(request, state, lease, Call.chat(chat))
    return await answer_io.whole(request, lease, answer, _Count())


class _Count:
    """Renders only the prompt's token count."""

    def __init__(self):
        self.input_tokens = 0

    def start(self) -> list[bytes]:
        return []

    def delta(self, reply: protocol.Delta) -> list[bytes]:
        return []

    async def done(self, usage: dict) -> list[bytes]:
        self.input_tokens = usage["prompt_tokens"]
        return []

    def error(self, exc: KvgateError) -> list[bytes]:
        return []

    def keepalive(self) -> bytes:
        return b""

    def result(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens}
