"""OpenAI's Responses API: `POST /v1/responses` becomes a chat request on the one request path
(`open_answer`: the same key, limits, routing, checks, reservation, dispatch and usage), rendered
as a response object or its typed events; `GET` and `DELETE /v1/responses/{id}` read and drop what
`store: true` kept, for the key that made it only."""
from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, Request

from gateway import answer_io, resume
from gateway.admission import Admitted, Lease, admit
from gateway.answer_items import Items
from gateway.deps import StateDep
from gateway.openai_api import Answer, Call, open_answer, resume_request
from gateway.responses_render import ResponseRender
from gateway.responses_schemas import ResponsesRequest
from gateway.responses_store import ResponseStore
from gateway.routing import VERSION_HEADER_DOC
from gateway.state import GatewayState
from gateway.strict_json import ParsedJSONRoute
from shared.errors import NotFound, QuotaExceeded

log = logging.getLogger("kvgate.gateway")
router = APIRouter(prefix="/v1", dependencies=[Depends(admit)], tags=["responses"],
                   route_class=ParsedJSONRoute)


def _store(state: StateDep) -> ResponseStore:
    return ResponseStore(state.redis, state.settings.response_retention_days * 86400)


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"No response with id '{response_id}' found", param="response_id",
                    code="response_not_found")


@router.post("/responses", openapi_extra=VERSION_HEADER_DOC)
async def create_response(body: ResponsesRequest, request: Request, lease: Admitted, state: StateDep,
                          store: ResponseStore = Depends(_store)):
    if lease.resuming:  # the client lost its stream and asks for the rest (Last-Event-ID)
        return await resume_request(request, state, lease, API)
    body.refuse_unserved()
    earlier = await _earlier(store, lease, body.previous_response_id)
    if body.store:
        await _check_room(store, lease, state.settings.max_stored_response_bytes_per_key)
    conversation = body.conversation(earlier)
    call = Call.chat(answer_io.chat_request(body.chat(conversation), CHAT_FIELDS))
    answer = await open_answer(request, state, lease, call)
    render = ResponseRender(body, "resp_" + answer.handle.request_id.removeprefix("chatcmpl-"),
                            Items(answer.shape.output(0)), None)
    if body.store:
        render.conversation = conversation
        render.store = _keeper(store, lease, conversation, render)
    if body.stream:
        return await answer_io.stream(request, state, lease, answer, call, API, render)
    return await answer_io.whole(request, lease, answer, render)


async def _resumed(state: GatewayState, lease: Lease, answer: Answer, spec: dict, after: int):
    """A Responses stream rebuilt at this gateway from what its render's spec kept; it keeps the
    response (store) if no gateway has yet: the one that streamed it may have died first."""
    body = ResponsesRequest.model_validate(spec["body"])
    render = ResponseRender(body, spec["id"], Items(answer.shape.output(0)), None)
    render.created = spec["created"]
    if spec.get("conversation") is not None:
        store = _store(state)
        keep = _keeper(store, lease, spec["conversation"], render)

        async def keep_once(response: dict) -> None:
            if await store.get(lease.key.id, response["id"]) is None:
                await keep(response)
        render.store = keep_once
    return answer_io.resumed(answer, lease, render, after)


API = "responses"
resume.RENDERS[API] = _resumed
CHAT_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens"}  # chat's names for this API's fields


@router.get("/responses/{response_id}")
async def get_response(response_id: str, lease: Admitted, store: ResponseStore = Depends(_store)) -> dict:
    kept = await store.get(lease.key.id, response_id)
    if kept is None:
        raise _not_found(response_id)
    return kept["response"]


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, lease: Admitted,
                          store: ResponseStore = Depends(_store)) -> dict:
    if not await store.delete(lease.key.id, response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


async def _earlier(store: ResponseStore, lease: Lease, previous: str | None) -> list[dict]:
    """The conversation the previous response ended, for this key (404 when it has none by that id)."""
    if previous is None:
        return []
    kept = await store.get(lease.key.id, previous)
    if kept is None:
        raise NotFound(f"Previous response with id '{previous}' not found", param="previous_response_id",
                       code="previous_response_not_found")
    return kept["conversation"]


async def _check_room(store: ResponseStore, lease: Lease, limit: int) -> None:
    used = await store.used(lease.key.id)
    if used >= limit:
        raise QuotaExceeded(f"Quota exceeded for key '{lease.key.name}' on stored responses "
                            f"(KVGATE_MAX_STORED_RESPONSE_BYTES_PER_KEY): Limit {limit}, Used {used}. "
                            "Delete stored responses, or send store: false.", param="store")


def _keeper(store: ResponseStore, lease: Lease, conversation: list[dict], render: ResponseRender):
    """What keeps the finished response; if Redis cannot, the answer still goes out, saying
    `store: false` (a follow-up naming it gets 404, not a silent restart)."""
    async def keep(response: dict) -> None:
        message = render.assistant_message()
        try:
            await store.put(lease.key.id, response, conversation + ([message] if message else []))
        except Exception as exc:
            log.warning("could not store response %s: %s", response["id"], type(exc).__name__)
            render.stored = False
    return keep
