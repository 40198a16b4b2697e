"""OpenAI's /v1/embeddings, served by the workers of an embedding model folder (worker/engine/pooling.py):
one entry of kind `embed` (schema 9) carries every input; the worker sends each input's vector as it is
made (base64 float32, passed through when the client asked for base64, as the openai client does by
default; decoded to floats otherwise).

Governance as a completion's: the key's model access, its request of the minute, a slot in flight
and the inputs' tokens reserved in one script with the XADD (estimated as a prompt's; settled to
what the worker counted), usage recorded. The version is the one this key's requests go to now (its
canary cohort), without counting toward the canary's analysis: an embedding's latency says nothing
of a generation's.
"""
from __future__ import annotations

import base64
import secrets
import time
from typing import Annotated, Literal, Union

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from gateway import bounds as b
from gateway import client_wait, estimate
from gateway.admission import Admitted, Lease, admit
from gateway.deps import StateDep
from gateway.registry import Facts
from gateway.limits import AdmitCall
from gateway.openai_api import json_body, reserving
from gateway.routing import VERSION_HEADER, Outcome
from gateway.schemas import TokenId
from gateway.state import GatewayState
from gateway.strict_json import ParsedJSONRoute
from gateway.validation import check_model_allowed, check_peer_features
from shared import names, protocol, telemetry
from shared.batches import BATCH_PRIORITY
from shared.errors import ContextLengthExceeded, EngineFailure, InvalidRequest, KvgateError

router = APIRouter(dependencies=[Depends(admit)], tags=["openai"], route_class=ParsedJSONRoute)

INPUTS = 2048  # as OpenAI allows; the worker bounds a request's vectors by their size too
DIMENSIONS = 1 << 16  # above any hidden size; the model's own is checked by the worker


class EmbeddingRequest(BaseModel):
    """OpenAI's body. `input` is one text, one list of token ids, or a list of either (at most
    2,048, none empty); every input is embedded alone. Unknown fields are refused by name (422):
    a field that would change the vectors must not be dropped in silence."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=b.MODEL_NAME_CHARS, examples=["demo-embed"])
    # normalized by `_inputs` to a list of inputs before these types are checked
    input: Union[Annotated[list[Annotated[str, StringConstraints(min_length=1)]], Field(fail_fast=True)],
                 Annotated[list[Annotated[list[TokenId], Field(min_length=1, fail_fast=True)]], Field(fail_fast=True)]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=DIMENSIONS, description="A Matryoshka model's shorter "
                                   "vectors (the first `dimensions`, normalized again); others refuse it")
    user: str | None = Field(None, max_length=b.USER_CHARS)
    # vLLM's: each input keeps its last k tokens (-1: as many as the model's context holds); unset, an
    # input past the context is a 400
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=b.MAX_TOKENS)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_something(cls, v):
        if v == 0:
            raise ValueError("truncate_prompt_tokens keeps the last k tokens of each input: k >= 1, or -1 for the "
                             "model's context length")
        return v

    @field_validator("input", mode="before")
    @classmethod
    def _inputs(cls, v):
        """One input becomes a list of one; the count and the ids all together are bounded, and a
        list that mixes texts and ids is named as such (the union would name one branch's error)."""
        if isinstance(v, str):
            return [v]
        if not isinstance(v, list):
            return v  # the union's own error
        if not v:
            raise ValueError("input must not be empty")
        if all(type(t) is int for t in v):
            v = [v]  # one input of token ids
        kinds = {type(t) for t in v}
        if len(kinds) > 1 or not kinds <= {str, list}:
            raise ValueError("input is a text, a list of token ids, or a list of texts or of token-id lists "
                             "(not a mix)")
        if len(v) > INPUTS:
            raise ValueError(f"{len(v)} inputs; at most {INPUTS} a request")
        if kinds == {list} and sum(map(len, v)) > b.PROMPT_TOKEN_IDS:
            raise ValueError(f"{sum(map(len, v))} token ids in all; at most {b.PROMPT_TOKEN_IDS} a request")
        return v

    def prompt(self) -> dict:
        """The inputs as an entry's prompt fields (estimate.each_prompt reads them)."""
        return {"prompts": self.input}


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request, lease: Admitted, state: StateDep):
    """Each input's vector, in order, with the tokens the worker counted as usage."""
    model = body.model
    version, facts = await pooling_model(lease, state, model, "embed")
    _check_ids(facts, body.input, truncated=body.truncate_prompt_tokens is not None)
    entry = pooled_entry(state, lease, model, version, "embed", prompts=body.input, dimensions=body.dimensions,
                         truncate=body.truncate_prompt_tokens)
    vectors, usage, headers = await run_pooled(request, lease, state, entry, facts.schema, len(body.input),
                                               _limits(request, state, lease, body, facts.max_model_len))
    if vectors is None:
        return Response(status_code=499)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)]
    return json_body({"object": "list", "data": data, "model": model, "usage": usage}, headers)


SERVES = {"generate": "generates text", "embed": "is an embedding model (/v1/embeddings)",
          "score": "is a reranker (/v1/score, /v1/rerank)"}
SERVED_BY = {"embed": ("serve embeddings", "an embedding model folder, or a worker started with --task embed"),
             "score": ("score pairs", "a reranker's folder, or a worker started with --task score")}


async def pooling_model(lease: Lease, state: GatewayState, model: str, task: str) -> tuple[str, Facts]:
    """The version this key's request goes to and its workers' facts, after the key's access to the
    model (403) and the model's task (400 naming it: the worker refuses too, for a worker not yet in
    the registry)."""
    check_model_allowed(lease.key, model)
    version = await state.router.version_for(model, lease.key)
    facts = await state.registry.facts(model, version)
    if facts.task is not None and facts.task != task:
        what, by = SERVED_BY[task]
        raise InvalidRequest(f"The model '{model}' {SERVES.get(facts.task, facts.task)}; it does not {what} ({by} "
                             "does)", param="model")
    return version, facts


def pooled_entry(state: GatewayState, lease: Lease, model: str, version: str, kind: str,
                 **fields) -> protocol.RequestEntry:
    """A pooling entry (kind embed or score, its own `fields`) under the key's lane, deadline and salt."""
    now = time.time()
    total_s = lease.timeouts.total_s if lease.timeouts else state.settings.request_timeout_s
    prefix = {"embed": "embd", "score": "score"}[kind]
    return protocol.RequestEntry(
        request_id=f"{prefix}-{secrets.token_hex(12)}", reply_channel=state.dispatcher.channel, model=model,
        version=version, kind=kind, created=now, deadline=now + total_s, key_id=lease.key.id,
        weight=lease.key.weight, priority=BATCH_PRIORITY if lease.lane == names.BATCH_LANE else 0,
        cache_salt=lease.key.cache_salt(), trace=telemetry.inject(), **fields)


async def run_pooled(request: Request, lease: Lease, state: GatewayState, entry: protocol.RequestEntry,
                     schema: int | None, count: int, before: AdmitCall) -> tuple[list[str] | None, dict, dict]:
    """Queue a pooling entry (an embedding's, a score's: `count` answers) with its admission script
    `before`, and wait for its answers (base64, as the worker sent them) and the usage the worker
    counted, recorded as prompt tokens; None for the answers when the client left (the request is
    cancelled). The worker's error raises, with the response's headers."""
    check_peer_features(entry, schema)
    model, version = entry.model, entry.version
    handle = await state.dispatcher.submit(
        names.request_stream(model, version, lease.lane), entry, interactive=lease.lane == names.DEFAULT_LANE,
        schema=schema, timeouts=lease.timeouts, before=before)
    lease.dispatched(model, handle, Outcome(model, version, None))  # no window: not a canary signal
    headers = {VERSION_HEADER: version, "x-request-id": entry.request_id}
    try:
        answer = await client_wait.unless_gone(request, collect_pooled(handle, count, state))
    except KvgateError as exc:
        raise exc.with_headers(headers)
    finally:
        handle.close("client_gone")
    if answer is None:  # the client left (the close above cancelled the request)
        return None, {}, headers
    answers, usage = answer
    lease.finished({**usage, "completion_tokens": 0})  # charged and recorded as a prompt's tokens
    return answers, usage, headers


async def collect_pooled(handle, count: int, state: GatewayState) -> tuple[list[str], dict]:
    """Each input's vector (base64, as the worker sent it; a scored pair's: its one score) once
    done; the worker's error raises."""
    vectors: list[str | None] = [None] * count
    async for reply in handle.replies(state.settings.keepalive_s):
        if isinstance(reply, protocol.Delta) and reply.embedding is not None and 0 <= reply.index < count:
            vectors[reply.index] = reply.embedding
        elif isinstance(reply, protocol.Done):
            if any(v is None for v in vectors):
                raise EngineFailure(f"the worker ended this request with {vectors.count(None)} of {count} "
                                    "inputs unanswered")
            return vectors, {"prompt_tokens": reply.prompt_tokens, "total_tokens": reply.prompt_tokens}
    raise EngineFailure("the worker's answer ended before it was done")


def _check_ids(facts, inputs: list, truncated: bool) -> None:
    """400 for a token-id input past the context (unless it is to be truncated) or outside the
    vocabulary, before anything is queued (text inputs are measured by the worker, which refuses
    likewise)."""
    for i, ids in enumerate(inputs):
        if isinstance(ids, str):
            return
        if facts.max_model_len is not None and len(ids) > facts.max_model_len and not truncated:
            raise ContextLengthExceeded(f"input {i} has {len(ids)} tokens; this model's maximum context length "
                                        f"is {facts.max_model_len} tokens", param="input")
        if facts.vocab_size is not None and max(ids) >= facts.vocab_size:
            token = next(t for t in ids if t >= facts.vocab_size)
            raise InvalidRequest(f"input {i}'s token id {token} is outside this model's vocabulary "
                                 f"[0, {facts.vocab_size})", param="input", code="invalid_token_id")


def _encoded(vector: str, encoding_format: str):
    """base64 as the worker sent it, or the float32 values for orjson to write (json_body): ~3x
    faster on the event loop than Python floats (8 MiB of vectors: 71 against 230 ms), and each
    number in its shortest float32 spelling."""
    if encoding_format == "base64":
        return vector
    import numpy  # (transformers brings it; imported here, a gateway that serves no float embeddings never loads it)

    return numpy.frombuffer(base64.b64decode(vector), dtype="<f4")


def _limits(request: Request, state: GatewayState, lease: Lease, body: EmbeddingRequest,
            max_model_len: int | None) -> AdmitCall:
    """The key's minute, its slot and the inputs' tokens (each at most what truncation keeps), in the
    XADD's round trip (as a completion's)."""
    keep = max_model_len if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens
    each = [estimate.prompt_tokens(one) for one in estimate.each_prompt(body.prompt())]
    return reserving(request, state, lease, sum(min(n, keep) if keep else n for n in each))
