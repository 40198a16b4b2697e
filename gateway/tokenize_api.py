"""vLLM's /tokenize, /detokenize and /tokenizer_info. The gateway has no tokenizer, so each is an
entry of its own kind (shared/protocol.py, schema v5; v8 for the info) on the model's stream, which a
worker's admission answers from its tokenizer without running the engine (worker/tokenizer_kinds.py).
As vLLM serving one model, each takes no model as the one served model the key may use.

Governance as on /v1: the same key, its model access (403), a request of its minute and a slot in
flight (admission), the same dispatcher and reply path, and one request in its usage. No tokens are
reserved or charged: nothing is generated and no KV is used, and the body limit and the key's RPM
bound the work. The version is the one this key's requests go to now (its canary cohort or sticky
bucket, without counting toward the canary's analysis), so its ids are those its generations read.
"""
from __future__ import annotations

import secrets
import time
from typing import Annotated

import orjson
from fastapi import APIRouter, Depends, Query

from gateway import bounds as b
from gateway import structured
from gateway.admission import Admitted, Lease, admit
from gateway.deps import StateDep
from gateway.openai_api import json_body
from gateway.registry import Facts
from gateway.routing import VERSION_HEADER, Outcome
from gateway.state import GatewayState
from gateway.strict_json import ParsedJSONRoute
from gateway.tokenize_schemas import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest,
                                      TokenizeResponse)
from gateway.validation import check_model_allowed, check_peer_features
from shared import names, protocol, telemetry
from shared.errors import ContextLengthExceeded, EngineFailure, InvalidRequest, KvgateError

router = APIRouter(dependencies=[Depends(admit)], tags=["vllm"], route_class=ParsedJSONRoute)
NOTHING_CHARGED = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, lease: Admitted, state: StateDep):
    """A prompt's ids, or a chat's as its template renders them (tools and template kwargs included)."""
    model = await _model_of(state, lease, body.model)
    if body.tools:  # the tools' schemas are read as chat reads them: tokenizing says what chat would refuse
        check_model_allowed(lease.key, model)
        await state.checker.check(structured.checks(None, body.tools), lease.key.id)
    reply, facts, headers = await _ask(state, lease, model, "tokenize", body.entry_fields())
    # a 1 MiB prompt is ~10^6 ids (and as many strings): written by orjson from the reply as it
    # came, not built into a model and encoded by the stdlib (~0.2 s of the event loop each)
    return json_body({"count": len(reply.token_ids), "max_model_len": facts.max_model_len,
                      "tokens": reply.token_ids, "token_strs": reply.token_strs}, headers)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, lease: Admitted, state: StateDep):
    reply, _, headers = await _ask(state, lease, await _model_of(state, lease, body.model), "detokenize",
                                   {"prompt_token_ids": body.tokens}, tokens=body.tokens)
    return json_body({"prompt": reply.text}, headers)


@router.get("/tokenizer_info")
async def tokenizer_info(lease: Admitted, state: StateDep,
                         model: Annotated[str | None, Query(min_length=1, max_length=b.MODEL_NAME_CHARS)] = None):
    """vLLM's: the model's special tokens, chat template, class and context length, so that a client
    tokenizes as the server does without the model folder (lm-evaluation-harness's remote tokenizer)."""
    reply, _, headers = await _ask(state, lease, await _model_of(state, lease, model), "tokenizer_info", {})
    return json_body(orjson.loads(reply.text), headers)


async def _model_of(state: GatewayState, lease: Lease, model: str | None) -> str:
    """The model named, or — named by none, as vLLM serving one model takes it — the one served model
    this key may use."""
    if model is not None:
        return model
    usable = [name for name in await state.registry.live_names() if lease.key.allows(name)]
    if len(usable) != 1:
        raise InvalidRequest(f"model is required: this key may use {len(usable)} served models"
                             + (f" ({', '.join(sorted(usable)[:8])}{', …' if len(usable) > 8 else ''})"
                                if usable else ""), param="model", code="model_required")
    return usable[0]


async def _ask(state: GatewayState, lease: Lease, model: str, kind: str, fields: dict,
               tokens: list[int] | None = None) -> tuple[protocol.Delta, Facts, dict[str, str]]:
    """The worker's answer: the key's model checks, the version, the entry, the dispatch."""
    check_model_allowed(lease.key, model)
    version = await state.router.version_for(model, lease.key)
    facts = await state.registry.facts(model, version)
    if tokens is not None:
        _check_tokens(facts, tokens)
    entry = _entry(state, lease, model, version, kind, fields)
    check_peer_features(entry, facts.schema)
    handle = await state.dispatcher.submit(names.request_stream(model, version, lease.lane), entry,
                                           interactive=False, schema=facts.schema, timeouts=lease.timeouts)
    lease.dispatched(model, handle, Outcome(model, version, None))  # no window: not a canary signal
    headers = {VERSION_HEADER: version, "x-request-id": entry.request_id}
    try:
        answer = None
        async for reply in handle.replies(state.settings.keepalive_s):
            if isinstance(reply, protocol.Delta):
                answer = reply
            elif isinstance(reply, protocol.Done):
                lease.finished(NOTHING_CHARGED)
    except KvgateError as exc:
        raise exc.with_headers(headers)
    finally:
        handle.close("client_gone")
    if answer is None:  # a worker of schema 5 always answers before done
        raise EngineFailure(f"the worker ended this {kind} request without an answer")
    return answer, facts, headers


def _check_tokens(facts: Facts, tokens: list[int]) -> None:
    """400 naming the limit: at most a context's worth, each id inside the vocabulary."""
    if facts.max_model_len is not None and len(tokens) > facts.max_model_len:
        raise ContextLengthExceeded(f"{len(tokens)} tokens to detokenize; this model's maximum context "
                                    f"length is {facts.max_model_len} tokens", param="tokens")
    if facts.vocab_size is None:
        return
    for position, token in enumerate(tokens):
        if token >= facts.vocab_size:
            raise InvalidRequest(f"token id {token} at position {position} is outside this model's "
                                 f"vocabulary [0, {facts.vocab_size})", param="tokens", code="invalid_token_id")


def _entry(state: GatewayState, lease: Lease, model: str, version: str, kind: str,
           fields: dict) -> protocol.RequestEntry:
    now = time.time()
    total_s = lease.timeouts.total_s if lease.timeouts else state.settings.request_timeout_s
    return protocol.RequestEntry(
        request_id=f"tok-{secrets.token_hex(12)}", reply_channel=state.dispatcher.channel, model=model,
        version=version, kind=kind, created=now, deadline=now + total_s, key_id=lease.key.id,
        trace=telemetry.inject(), **fields)
