"""The OpenAI-compatible routes. One function per hop: admit (key, rpm, slot; a dependency) →
refuse what kvgate would ignore → check the key may use the model → route → check the context,
tools and constraint → reserve tokens → dispatch → respond."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from gateway import client_wait, estimate, resume, structured, tool_calls
from gateway.admission import Admitted, Lease, admit, set_ratelimit_headers
from gateway.breaker import Refused
from gateway.deps import StateDep
from gateway.dispatch import KEEPALIVE, Handle, LogFollower, Lookahead
from gateway.holdings import Holdings
from gateway.limits import Admission, AdmitCall
from gateway.routing import VERSION_HEADER, VERSION_HEADER_DOC, observed
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.state import GatewayState
from gateway.stream_leases import ABANDONED, Attach, StreamLease
from gateway.strict_json import ParsedJSONRoute
from gateway.unsupported import check_supported
from gateway.validation import (check_context, check_model_allowed, check_output_limits,
                                check_peer_features, check_token_ids)
from shared import logs, names, protocol, telemetry, tool_parsers
from shared.batches import BATCH_PRIORITY
from shared.errors import InvalidRequest, KvgateError, NotFound, RateLimited

log = logging.getLogger("kvgate.gateway")
router = APIRouter(prefix="/v1", dependencies=[Depends(admit)], tags=["openai"],
                   route_class=ParsedJSONRoute)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


@dataclass(frozen=True)
class Call:
    """What `_serve` needs of one API's request: the validated body, which API it came by, the
    prompt as the entry carries it (messages, prompt, prompt_token_ids or a batch's prompts), and
    what the chat template is rendered with besides (tools, chat_template_kwargs)."""

    body: ChatCompletionRequest | CompletionRequest
    kind: Literal["chat", "completion"]
    prompt: dict[str, Any]
    template: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def chat(cls, body: ChatCompletionRequest) -> Call:
        messages = [m.entry() for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        return cls(body, "chat", {"messages": messages},
                   {"tools": tools, "chat_template_kwargs": body.template_kwargs()})

    @classmethod
    def completion(cls, body: CompletionRequest) -> Call:
        prompt = body.prompt
        if isinstance(prompt, str):
            return cls(body, "completion", {"prompt": prompt})
        if isinstance(prompt[0], int):
            return cls(body, "completion", {"prompt_token_ids": prompt})
        return cls(body, "completion", {"prompts": prompt})  # a batch: strings, or id lists

    def choices(self) -> int:
        """Choices in the answer: n, of each prompt of a batched completion."""
        return self.body.n * (self.body.num_prompts() if self.kind == "completion" else 1)

    def echoes_tokens(self) -> bool:
        """A completion that echoes prompts of token ids: the worker sends their text (the gateway has
        no tokenizer)."""
        prompts = self.prompt.get("prompts")
        return (self.kind == "completion" and self.body.echo
                and ("prompt_token_ids" in self.prompt or bool(prompts) and isinstance(prompts[0], list)))

    def include_usage(self) -> bool:
        options = self.body.stream_options
        return bool(options and options.include_usage)


@dataclass(frozen=True)
class Answer:
    """A dispatched request's way back: its replies, the shape they are written in, and the
    headers that name the version and the request id on every response, errors included."""

    handle: Handle
    replies: AsyncIterator
    shape: _Shape
    headers: dict[str, str]


@router.get("/models")
async def list_models(lease: Admitted, state: StateDep) -> dict:
    """Served names that have a live worker."""
    live = await state.registry.live_names()
    return {"object": "list", "data": [await _model_card(state, n, lease) for n in live]}


@router.get("/models/{model_id:path}")  # a served name may have a slash (meta-llama/Llama-3.2-1B)
async def get_model(model_id: str, lease: Admitted, state: StateDep) -> dict:
    if model_id not in await state.registry.live_names():
        raise NotFound(f"The model '{model_id}' does not exist", param="model")
    return await _model_card(state, model_id, lease)


@router.post("/chat/completions", openapi_extra=VERSION_HEADER_DOC)
async def chat_completions(body: ChatCompletionRequest, request: Request, lease: Admitted,
                           state: StateDep):
    return await _serve(request, state, lease, Call.chat(body))


@router.post("/completions", openapi_extra=VERSION_HEADER_DOC)
async def completions(body: CompletionRequest, request: Request, lease: Admitted, state: StateDep):
    return await _serve(request, state, lease, Call.completion(body))


@router.get("/streams/{request_id}", response_class=StreamingResponse)
async def resume_stream(request_id: str, lease: Admitted, state: StateDep,
                        last_event_id: str | None = Header(
                            None, alias="Last-Event-ID", description="The last event id received "
                            "(<request id>:<sequence>); without it the stream starts over")):
    """The rest of a stream of this key's (the events after `Last-Event-ID`), whether the request
    still runs or has finished, within its reply log's lifetime; 404 for any other."""
    point = resume.point(last_event_id)
    if point is not None and point[0] != request_id:
        raise InvalidRequest(f"Last-Event-ID names request '{point[0]}', not '{request_id}'",
                             param="Last-Event-ID", code="invalid_last_event_id")
    return await _resume(state, lease, request_id, point[1] if point else -1)


async def _serve(request: Request, state: GatewayState, lease: Lease, call: Call):
    if lease.resuming:  # the client lost its stream and asks for the rest (Last-Event-ID)
        return await resume_request(request, state, lease)
    answer = await open_answer(request, state, lease, call)
    if call.body.stream:
        return await _stream(request, state, lease, answer, call)
    return await _whole(request, lease, answer, state.settings.max_answer_logprobs)


async def open_answer(request: Request, state: GatewayState, lease: Lease, call: Call) -> Answer:
    """Every check, the admission and the dispatch of one call; its replies come back through
    the answer. The one request path: other APIs translate to a `Call` and render the answer."""
    body = call.body
    check_supported(body)
    constraint = body.constraint()
    check_model_allowed(lease.key, body.model)
    lease.key.check_priority(body.priority)
    check_output_limits(body.min_tokens, body.limit())
    forced = request.headers.get(VERSION_HEADER)
    # the version's breaker is passed at the XADD, in its round trip
    outcome = await state.router.choose(body.model, lease.key, forced, through_breaker=False)
    facts, outputs, entry = await _prepared(state, lease, call, outcome.version)
    tools = body.tools if call.kind == "chat" else None
    await state.checker.check(structured.checks(constraint, tools), lease.key.id)
    limits = await _limits(request, state, lease, call, facts.max_model_len)
    logs.rename_request(entry.request_id)
    try:  # the key's limits, then the XADD: one round trip when they can share it (dispatch.py)
        handle = await _submit(state, lease, entry, facts, outcome, gate=True, before=limits)
    except Refused:  # a canary's request goes to its stable version, or the 503 stands
        outcome = await state.router.past_breaker(outcome, forced is not None)
        if outcome.version != entry.version:
            facts, outputs, entry = await _prepared(state, lease, call, outcome.version)
            logs.rename_request(entry.request_id)
        handle = await _submit(state, lease, entry, facts, outcome, gate=False)
    version = outcome.version
    lease.dispatched(body.model, handle, outcome)
    handle.on_absorbed = outcome.absorbed
    return Answer(handle, observed(handle.replies(state.settings.keepalive_s), outcome),
                  _Shape(call.kind, entry.request_id, body.model, call.choices(), outputs, _Echo.of(call)),
                  {VERSION_HEADER: version, "x-request-id": entry.request_id})


async def _prepared(state: GatewayState, lease: Lease, call: Call, version: str):
    """What serving `call` from `version` takes: its workers' facts, the checks against them, the
    outputs' readers and the entry to queue."""
    body = call.body
    facts = await state.registry.facts(body.model, version)
    if facts.task in ("embed", "score"):  # (the worker refuses too: a worker may join before the registry says)
        what, served = (("an embedding model", "/v1/embeddings") if facts.task == "embed"
                        else ("a reranker", "/v1/score and /v1/rerank"))
        raise InvalidRequest(f"The model '{body.model}' is {what}: it serves {served}, not generation", param="model")
    check_context(facts.max_model_len, body.limit(), call.prompt)  # by length: before the ids
    check_token_ids(facts.vocab_size, call.prompt, body.stop_token_ids, body.logit_bias)
    outputs = _outputs(call, facts.tool_call_parser)
    entry = _entry(state, lease, call, version)
    check_peer_features(entry, facts.schema)
    return facts, outputs, entry


async def _submit(state: GatewayState, lease: Lease, entry: protocol.RequestEntry, facts, outcome,
                  gate: bool, before: AdmitCall | None = None) -> Handle:
    stream = names.request_stream(entry.model, entry.version, lease.lane)
    return await state.dispatcher.submit(stream, entry, interactive=lease.lane == names.DEFAULT_LANE,
                                         schema=facts.schema, probe=outcome.probe,
                                         timeouts=lease.timeouts, gate=gate, before=before)


async def _whole(request: Request, lease: Lease, answer: Answer, max_logprobs: int) -> Response:
    """`stream: false`: one JSON body once the request is done."""
    try:
        result = await client_wait.unless_gone(request, _collect(answer.replies, answer.shape,
                                                                 max_logprobs))
    except KvgateError as exc:  # an error the version answered with still names it (and the id)
        raise exc.with_headers(client_wait.named(answer))
    finally:
        answer.handle.close("client_gone")
    if result is None:  # the client left: nobody to answer (the close above cancelled the request)
        return Response(status_code=499)
    lease.finished(result["usage"])
    return json_body(result, client_wait.named(answer))


async def _stream(request: Request, state: GatewayState, lease: Lease, answer: Answer,
                  call: Call) -> Response:
    """The 200 goes out once the worker admitted the request (its first reply) or after
    KVGATE_ADMISSION_WAIT_S, whichever is first (gateway/client_wait.py). Before the 200, the
    stream's holdings go to Redis, so that it can be resumed, and settled, at any gateway."""
    ahead = await first_reply_held(request, state, lease, answer, call)
    if ahead is None:
        return Response(status_code=499)
    gen = _sse(answer, ahead, lease, call.include_usage())
    # the close also runs if the client left before the generator ever started (its `finally`
    # would not): the request is cancelled and its reply queue released either way
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={**SSE_HEADERS, **client_wait.named(answer)},
                             background=BackgroundTask(answer.handle.aclose, "client_disconnected"))


async def first_reply_held(request: Request, state: GatewayState, lease: Lease, answer: Answer, call: Call,
                           api: dict | None = None) -> Lookahead | None:
    """The first reply (`client_wait.first_reply`: None when the client left first, a refusal
    raises), the stream's lease written meanwhile (gateway/stream_leases.py): its round trip runs
    while the worker computes the first token, not after it. Once the request is admitted the
    stream is held in Redis, resumable and settled at any gateway; if Redis would not take the
    lease it goes on unresumable and is settled here, as before. A lease written for a request that
    never started (refused, or its client gone) is settled at once (`Lease.unstarted`). `api`:
    another API's renderer, as `{"api": name, "render": what rebuilds it}` (gateway/answer_io.py)."""
    writing = asyncio.ensure_future(_write_lease(state, lease, answer, call, api))
    try:
        ahead = await client_wait.first_reply(request, answer, state.settings.admission_wait_s)
    except BaseException:
        await _unstarted(state, lease, writing)
        raise
    if ahead is None:
        await _unstarted(state, lease, writing)
        return None
    written = await writing
    if written is None:
        return ahead
    stream, attempt_id = written
    if attempt_id != answer.handle.request_id:  # sent again before its first token: written anew
        again = await _write_lease(state, lease, answer, call, api)
        if again is None:  # the lease names an attempt that is gone: let go, and settled here
            _let_go(state, stream)
            return ahead
        stream = again[0]
    lease.streamed(stream)
    handle = answer.handle
    handle.outlives_client = state.settings.resume_grace_s > 0
    handle.on_attempt = lambda attempt: state.streams.follow(stream, attempt)
    return ahead


async def _write_lease(state: GatewayState, lease: Lease, answer: Answer, call: Call,
                       api: dict | None) -> tuple[StreamLease, str] | None:
    """The stream's lease written, with the attempt it follows; None if Redis would not take it."""
    body, handle = call.body, answer.handle
    chat = call.kind == "chat"
    attempt_id = handle.request_id
    try:
        parser = ((await state.registry.facts(body.model, lease.version)).tool_call_parser
                  if chat and body.tools else None)
        spec = resume.shape_spec(call.kind, body.model, call.choices(), answer.shape.created, call.include_usage(),
                                 body.tools if chat else None, body.choice() if chat else None,
                                 body.parallel_tool_calls if chat else True, parser,
                                 answer.shape.echo.spec())
        spec.update(api or {})
        stream = StreamLease(lease.key.id, answer.shape.id)
        await state.streams.open(stream, lease.holdings(), handle.deadline, spec, attempt_id)
    except Exception as exc:
        log.warning("stream %s is not resumable (%s)", answer.shape.id, type(exc).__name__)
        return None
    return stream, attempt_id


async def _unstarted(state: GatewayState, lease: Lease, writing: asyncio.Future) -> None:
    """The request never started: a lease written meanwhile is settled with the request, at once."""
    try:
        written = await asyncio.shield(writing)
    except BaseException:  # cancelled again while it writes: the lease, once written, is let go
        writing.add_done_callback(lambda done: _abandon(state, done))
        return
    if written is not None:
        lease.streamed(written[0])
        lease.unstarted = True


def _abandon(state: GatewayState, writing: asyncio.Future) -> None:
    """A lease written for a request whose task was torn down meanwhile: marked settled (the
    request's holdings are settled where it ran, as if no lease had been written)."""
    if writing.cancelled() or writing.exception() is not None or writing.result() is None:
        return
    _let_go(state, writing.result()[0])


def _let_go(state: GatewayState, stream: StreamLease) -> None:
    """A written lease nobody will settle through: claimed as abandoned, in the background."""
    state.dispatcher.spawn(state.streams.claim(stream, ABANDONED, honour_hold=False))


async def resume_request(request: Request, state: GatewayState, lease: Lease,
                         api: str | None = None) -> Response:
    """The rest of the stream a request's Last-Event-ID names, sent on the route it came by: a
    stream of another API (`api`: None for chat and completions) is refused, not rendered in the
    wrong shape."""
    request_id, after = resume.point(request.headers[resume.HEADER])
    return await _resume(state, lease, request_id, after, api or "")


async def _resume(state: GatewayState, lease: Lease, request_id: str, after: int,
                  api: str | None = None) -> Response:
    """The events of this key's stream `request_id` after sequence `after`, rebuilt from its reply
    log; this gateway takes over its settlement unless it is over and settled already. `api`: the
    API the stream must be of (None: any, as /v1/streams serves every API's)."""
    stream = StreamLease(lease.key.id, request_id)
    record = await state.streams.find(stream)
    follower = LogFollower(state.dispatcher, record.get("follow", request_id) if record else request_id,
                           float(record["deadline"]) if record else 0, record and record.get("channel"))
    if record is None or record.get("settled") == ABANDONED:
        got = Attach.GONE
    else:  # counted before it takes the stream over: a refused resume leaves the lease as it was
        await _within_resumes(state, stream)
        got = await state.streams.attach(stream)
    if got == Attach.SETTLED and not await state.redis.exists(names.checkpoint_key(request_id)):
        got = Attach.GONE
    if got == Attach.GONE:
        raise NotFound(f"No stream '{request_id[:100]}' of this key to resume: unknown, another "
                       "key's, cancelled after its client stayed away longer than "
                       "KVGATE_RESUME_GRACE_S, or older than its reply log",
                       param="Last-Event-ID", code="stream_not_found")
    spec = orjson.loads(record["shape"])
    if api is not None and spec.get("api", "") != api:
        theirs = spec.get("api") or "chat or completions"
        raise InvalidRequest(f"Last-Event-ID names a stream of another API ({theirs}); resume it on "
                             "its own route, or with GET /v1/streams/<request id>",
                             param="Last-Event-ID", code="invalid_last_event_id")
    if got == Attach.HELD:
        lease.adopt(stream, Holdings.from_fields(record), follower)
    follower.outlives_client = got == Attach.SETTLED or state.settings.resume_grace_s > 0
    shape = _Shape(spec["kind"], request_id, spec["model"], spec["n"], resume.outputs_of(spec),
                   _Echo.from_spec(spec.get("echo")))
    shape.created = spec["created"]
    headers = {VERSION_HEADER: record["version"], "x-request-id": request_id}
    answer = Answer(follower, Lookahead(follower.replies(state.settings.keepalive_s)), shape, headers)
    if spec.get("api"):  # another API's events (gateway/answer_io.py)
        return await resume.RENDERS[spec["api"]](state, lease, answer, spec["render"], after)
    return StreamingResponse(_sse(answer, answer.replies, lease, spec["include_usage"], after),
                             media_type="text/event-stream", headers={**SSE_HEADERS, **headers},
                             background=BackgroundTask(follower.aclose, "client_disconnected"))


async def _within_resumes(state: GatewayState, stream: StreamLease) -> None:
    """429 past KVGATE_MAX_RESUMES_PER_MINUTE resumes of one stream: a replay costs the gateway what
    the stream first did, and resumes count against no other limit (a client must get its stream
    back), so one request may not buy an unbounded number of them."""
    count, left_s = await state.streams.resumed(stream)
    limit = state.settings.max_resumes_per_minute
    if count > limit:
        raise RateLimited(f"Stream '{stream.request_id[:100]}' was resumed {limit} times in the last "
                          f"minute, the most KVGATE_MAX_RESUMES_PER_MINUTE allows; retry after "
                          f"{left_s} s", param="Last-Event-ID", code="too_many_resumes",
                          retry_after=left_s)


@telemetry.traced("limits.tokens")
async def _limits(request: Request, state: GatewayState, lease: Lease, call: Call,
                  max_model_len: int | None) -> AdmitCall:
    """Tokens per minute and per day: the estimate to charge, with (for a generation admission
    deferred to here) its request of the minute and its slot, as one script call the dispatcher
    makes (with the XADD, in the dispatch span, or just before it); admission's teardown settles
    them."""
    body = call.body
    tokens = estimate.request_tokens(call.prompt, body.limit(), body.n, max_model_len,
                                     state.settings.default_reserve_tokens)
    return reserving(request, state, lease, tokens)


def reserving(request: Request, state: GatewayState, lease: Lease, tokens: int) -> AdmitCall:
    """The admission script call that reserves `tokens` (and, for a deferred admission, takes the
    request's minute and slot); `conclude` files its verdict with the lease."""
    count = lease.deferred
    prepared = state.limits.prepare(lease.key, count=count, slot_id=lease.slot_id if count else None,
                                    total_s=lease.timeouts.total_s, estimate=tokens)

    def conclude(answer: list) -> Admission:
        lease.deferred = False  # its minute is ADMIT's to count now, whatever the verdict
        admission = prepared.conclude(answer)
        lease.admitted(admission)
        set_ratelimit_headers(request, admission.headers)
        return admission
    return dataclasses.replace(prepared, conclude=conclude)


def _outputs(call: Call, parser: str | None):
    """Per choice, what turns its text into content and tool calls (400 for tools not served)."""
    body = call.body
    if call.kind != "chat":
        return lambda: tool_calls.ChoiceOutput(tool_calls.reader(None, None, None))
    parser = parser if parser in tool_parsers.PARSERS else None  # one a newer worker knows: none here
    tool_calls.check(body.tools, body.choice(), parser)
    return lambda: tool_calls.ChoiceOutput(tool_calls.reader(body.tools, body.choice(), parser),
                                           body.parallel_tool_calls)


def _entry(state: GatewayState, lease: Lease, call: Call, version: str) -> protocol.RequestEntry:
    settings, body = state.settings, call.body
    prefix = "chatcmpl" if call.kind == "chat" else "cmpl"
    now = time.time()
    return protocol.RequestEntry(
        request_id=f"{prefix}-{secrets.token_hex(12)}", reply_channel=state.dispatcher.channel,
        model=body.model, version=version, kind=call.kind, params=body.to_sampling_params(),
        created=now, deadline=now + _total_s(settings, lease), key_id=lease.key.id, weight=lease.key.weight,
        priority=body.priority + (BATCH_PRIORITY if lease.lane == names.BATCH_LANE else 0),
        cache_salt=lease.key.cache_salt(), trace=telemetry.inject(), streamed=bool(body.stream),
        from_model=body.left_to_model(), echo_prompt=call.echoes_tokens(), **call.prompt, **call.template)


def _total_s(settings, lease: Lease) -> float:
    return lease.timeouts.total_s if lease.timeouts else settings.request_timeout_s


ONE_PROMPT = 1 << 30  # _Echo.per of a request with one prompt: choice i // it is 0 for every choice


@dataclass
class _Echo:
    """What a completion gives back of its prompt: the text (echo), its tokens' logprobs before the
    choice's own (echo with logprobs, OpenAI's legacy shape), vLLM's `prompt_logprobs` field; and
    the prompt's scores once the worker sent them (on the prompt's first choice's first delta). A
    batched completion has one of each a prompt: choice i's is prompt i // `per`'s."""

    texts: list[str] | None = None
    with_logprobs: bool = False
    vllm_field: bool = False
    text_from_worker: bool = False  # prompts of token ids: their text comes on the verdict (`heard`)
    per: int = ONE_PROMPT  # choices a prompt: a batch's n; one prompt's every choice
    scores: dict[int, list[dict]] = dataclasses.field(default_factory=dict)  # prompt -> its scores
    echoed: set[int] = dataclasses.field(default_factory=set)  # choices whose prompt text went out

    @classmethod
    def of(cls, call: Call) -> _Echo:
        body = call.body
        if call.kind != "completion":
            return cls()
        tokens, batch = call.echoes_tokens(), body.num_prompts() > 1
        texts = None if not body.echo or tokens else body.prompt if batch else [body.prompt]
        return cls(texts, body.echo and body.logprobs is not None, body.prompt_logprobs is not None, tokens,
                   body.n if batch else ONE_PROMPT)

    def spec(self) -> dict | None:
        """What a resumed stream needs of it (gateway/resume.py); None: nothing to echo. (A resumed
        stream reads its replies from the start: the verdict brings a worker's text again.) One
        prompt's is written as the previous release wrote it, which a gateway of that release reads."""
        if self.texts is None and not (self.with_logprobs or self.vllm_field or self.text_from_worker):
            return None
        spec = {"with_logprobs": self.with_logprobs, "vllm_field": self.vllm_field}
        if self.text_from_worker or self.per != ONE_PROMPT:
            return spec | {"texts": self.texts, "text_from_worker": self.text_from_worker, "per": self.per}
        return spec | {"text": self.texts[0] if self.texts else None}

    @classmethod
    def from_spec(cls, spec: dict | None) -> _Echo:
        if not spec:
            return cls()
        if "text" in spec:  # one prompt's
            text = spec["text"]
            spec = {name: value for name, value in spec.items() if name != "text"} | {
                "texts": None if text is None else [text]}
        return cls(**spec)

    def heard(self, reply: protocol.Delta) -> None:
        """The prompts' text, from the verdict of a request whose prompts came as token ids."""
        if self.text_from_worker and reply.prompt_texts is not None:
            self.texts = reply.prompt_texts

    def scored(self, reply: protocol.Delta) -> None:
        """A prompt's scores, from its first choice's first delta."""
        if reply.prompt_logprobs is not None:
            self.scores[reply.index // self.per] = reply.prompt_logprobs

    def text(self, index: int) -> str:
        """The echoed text before choice `index`'s own ("" without echo)."""
        return self.texts[index // self.per] if self.texts is not None else ""

    def text_of(self, index: int, text: str) -> str:
        """A streamed choice's text: its first chunk starts with the prompt."""
        if self.texts is None or index in self.echoed:
            return text
        self.echoed.add(index)
        return self.text(index) + text

    def logprobs(self, index: int, lps: list | None, made: Callable[[dict], Any] | None = None) -> list | None:
        """The prompt's entries (the first has no logprob: nothing predicts it) before choice `index`'s
        `lps`; each `made` into the shape `lps` already has, when given."""
        scores = self.scores.get(index // self.per)
        if not self.with_logprobs or scores is None:
            return lps
        return (scores if made is None else [made(e) for e in scores]) + (lps or [])

    def vllm(self, scores: list[dict] | None) -> list | None:
        """vLLM's shape: per prompt token None or {token id: {logprob, rank, decoded_token}} for
        the token itself and its top entries."""
        if scores is None:
            return None
        def entry(e: dict) -> dict:
            out = {str(t): {"logprob": v, "rank": r + 1, "decoded_token": text}
                   for r, (t, (text, v)) in enumerate(zip(e["top_ids"], e["top"]))}
            out.setdefault(str(e["token_id"]), {"logprob": e["logprob"], "rank": e["rank"],
                                                "decoded_token": e["token"]})
            return out
        return [None if e["logprob"] is None else entry(e) for e in scores]


class _Shape:
    """Builds OpenAI's response objects for one request (chat or text completion)."""

    def __init__(self, kind: str, request_id: str, model: str, n: int, outputs, echo: _Echo | None = None):
        self.kind, self.id, self.model, self.n = kind, request_id, model, n
        self.created = int(time.time())
        self.new_output = outputs  # () -> how one choice's text becomes content and tool calls
        self.outputs: dict[int, tool_calls.ChoiceOutput] = {}
        self.echo = echo or _Echo()

    def output(self, index: int) -> tool_calls.ChoiceOutput:
        if index not in self.outputs:
            self.outputs[index] = self.new_output()
        return self.outputs[index]

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def entry(self, e: dict) -> dict | tuple:
        """One token's log-probabilities from the wire, made into this answer's shape as it comes
        (a whole answer's 168,000 entries made at its end held the event loop ~0.1 s in one go)."""
        return _chat_entry(e) if self.kind == "chat" else _text_entry(e)

    def delta_choice(self, d: protocol.Delta) -> dict | None:
        """The chunk's choice for this delta; None when it has nothing to say yet (text a tool-call
        parser holds back until it knows whether it is a call)."""
        if self.kind == "chat":
            out = self.output(d.index)
            delta = out.delta(d.text, d.finish_reason is not None)
            if d.reasoning:
                delta["reasoning_content"] = d.reasoning
            if not (delta or d.finish_reason or d.logprobs):
                return None
            return {"index": d.index, "delta": delta, "logprobs": _chat_logprobs(d.logprobs),
                    "finish_reason": out.finish_reason(d.finish_reason)}
        self.echo.scored(d)
        lps = self.echo.logprobs(d.index, d.logprobs) if d.index not in self.echo.echoed else d.logprobs
        choice = {"index": d.index, "text": self.echo.text_of(d.index, d.text),
                  "logprobs": _text_logprobs(lps), "finish_reason": d.finish_reason}
        if self.echo.vllm_field and d.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.echo.vllm(d.prompt_logprobs)
        return choice

    def role_choices(self) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(self.n)]

    def final(self, texts: dict, reasons: dict, logprobs: dict, usage: dict,
              reasoning: dict | None = None) -> dict:
        """The whole answer; `logprobs`: each choice's entries as `entry` made them."""
        choices = []
        for i in range(self.n):
            lps = logprobs.get(i)
            if self.kind == "chat":
                out = self.output(i)
                message = out.message(texts.get(i, ""))
                if (reasoning or {}).get(i):
                    message["reasoning_content"] = reasoning[i]
                choices.append({"index": i, "message": message,
                                "logprobs": None if lps is None else {"content": lps},
                                "finish_reason": out.finish_reason(reasons.get(i))})
            else:
                choices.append(self._text_choice(i, texts.get(i, ""), lps, reasons.get(i)))
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage}

    def _text_choice(self, i: int, text: str, entries: list | None, reason: str | None) -> dict:
        """A whole completion choice: the echoed prompt (and its logprobs) first."""
        echo = self.echo
        entries = echo.logprobs(i, entries, _text_entry)
        choice = {"index": i, "text": echo.text(i) + text,
                  "logprobs": None if entries is None else _text_shape(entries), "finish_reason": reason}
        if echo.vllm_field:
            choice["prompt_logprobs"] = echo.vllm(echo.scores.get(i // echo.per))
        return choice


def _usage(done: protocol.Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def _chat_logprobs(lps: list[dict] | None) -> dict | None:
    return None if lps is None else {"content": [_chat_entry(e) for e in lps]}


def _chat_item(tok: str, lp: float, raw: list[int] | None) -> dict:
    return {"token": tok, "logprob": lp, "bytes": list(tok.encode()) if raw is None else raw}


def _chat_entry(e: dict) -> dict:
    """One token in OpenAI's chat shape: every top entry in rank order, each with its token's real
    bytes (sent by the worker; a worker of the previous release sent none: its text's bytes then)."""
    raws = e.get("top_bytes") or [None] * len(e["top"])
    return {**_chat_item(e["token"], e["logprob"], e.get("bytes")),
            "top_logprobs": [_chat_item(t, v, raw) for (t, v), raw in zip(e["top"], raws)]}


def _text_logprobs(lps: list[dict] | None) -> dict | None:
    return None if lps is None else _text_shape([_text_entry(e) for e in lps])


def _text_entry(e: dict) -> tuple:
    # an echoed prompt's first token has no entry: null logprob and top, OpenAI's legacy shape
    return e["token"], e["logprob"], None if e["logprob"] is None else _text_top(e)


def _text_shape(entries: list[tuple]) -> dict:
    return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [e[2] for e in entries]}


def _text_top(e: dict) -> dict[str, float]:
    """Completions' top entries are a dict text -> logprob (OpenAI's shape), so two tokens with the
    same text would collapse into one: the second and later are keyed `token_id:<id>`, vLLM's
    spelling under --return-tokens-as-token-ids, and the client gets every entry it asked for."""
    out: dict[str, float] = {}
    for (text, lp), token_id in zip(e["top"], e.get("top_ids") or [None] * len(e["top"])):
        key = f"token_id:{token_id}" if text in out and token_id is not None else text
        out.setdefault(key, lp)
    return out


async def _collect(replies: AsyncIterator, shape: _Shape, max_logprobs: int) -> dict:
    """The whole answer. Its text is gathered in pieces (joining as it came copied each choice's
    text again for every token: quadratic). Its log-probabilities are what a non-streamed answer
    can grow large by (~330 bytes each once decoded: 16 choices of 2,000 tokens with 20 top
    entries were 224 MB), so past `max_logprobs` the request ends with answer_too_large."""
    texts: dict[int, list[str]] = {}
    reasoning: dict[int, list[str]] = {}
    reasons: dict[int, str | None] = {}
    logprobs: dict[int, list] = {}
    kept = 0
    async for reply in replies:
        if isinstance(reply, protocol.Delta):
            shape.echo.heard(reply)
            texts.setdefault(reply.index, []).append(reply.text)
            if reply.reasoning:
                reasoning.setdefault(reply.index, []).append(reply.reasoning)
            if reply.logprobs is not None:
                kept += sum(1 + len(entry.get("top") or ()) for entry in reply.logprobs)
                if kept > max_logprobs:
                    raise InvalidRequest(
                        f"The answer's log-probabilities passed {max_logprobs} (each token's and "
                        "each of its top alternatives count one; KVGATE_MAX_ANSWER_LOGPROBS): send "
                        "it with stream: true, or ask for fewer tokens, choices or top_logprobs",
                        code="answer_too_large")
                logprobs.setdefault(reply.index, []).extend(map(shape.entry, reply.logprobs))
            shape.echo.scored(reply)
            if reply.finish_reason:
                reasons[reply.index] = reply.finish_reason
        elif isinstance(reply, protocol.Done):
            return shape.final({i: "".join(t) for i, t in texts.items()}, reasons, logprobs,
                               _usage(reply), {i: "".join(t) for i, t in reasoning.items()})
    raise AssertionError("reply stream ended without done")  # pragma: no cover


def json_body(obj: Any, headers: dict[str, str] | None = None) -> Response:
    """A whole answer as JSON, encoded by orjson as the streamed events are: Starlette's
    JSONResponse uses the stdlib's encoder, ~10x slower on the event loop (an 18 MB answer held it
    for ~0.5 s), and a 500 for a logprob of -inf where a stream sends null. Numpy arrays are written
    by orjson itself (embeddings' float32 vectors: no Python float made for each element)."""
    return Response(orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json",
                    headers=headers)


# JSON allows U+0085, U+2028 and U+2029 raw in strings (orjson leaves them so), but line splitters
# built on str.splitlines (httpx's aiter_lines, many hand-written SSE clients) break a data line at
# them: a model that generates one would cut its event in two for such a client.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def sse_data(obj: Any) -> bytes:
    """obj as JSON for an event's one data line: orjson's, with those three escaped (the same JSON)."""
    data = orjson.dumps(obj)
    if not data.isascii():
        for raw, escaped in _LINE_BREAKS:
            data = data.replace(raw, escaped)
    return data


def _event(obj: Any, event_id: bytes = b"") -> bytes:
    return event_id + b"data: " + sse_data(obj) + b"\n\n"


async def _sse(answer: Answer, replies: AsyncIterator, lease: Lease, include_usage: bool,
               after: int = -1) -> AsyncIterator[bytes]:
    """Writes each delta the moment it arrives, as an event whose id is its reply's sequence
    number; a resumed stream (`after` >= 0) reads its replies from the start but sends only the
    events after `after`. A disconnect cancels the request (in `finally`), unless it may be resumed
    within KVGATE_RESUME_GRACE_S."""
    shape, rid = answer.shape, answer.shape.id  # the id the client knows, whichever attempt serves it
    try:
        if shape.kind == "chat" and after < 0:
            yield _event(shape.chunk(shape.role_choices()), resume.event_id(rid, 0))
        try:
            async for reply in replies:
                if reply is KEEPALIVE:
                    # a comment line without the blank line that ends an event: once an event
                    # had an `id:`, the openai client dispatches every blank line as an event
                    # with that id and no data, and fails to parse it (the SSE spec keeps the id)
                    yield b": keep-alive\n"
                    continue
                new = reply.seq > after
                if isinstance(reply, protocol.Delta):
                    shape.echo.heard(reply)
                    if not (reply.text or reply.reasoning or reply.finish_reason or reply.logprobs
                            or reply.prompt_logprobs):
                        continue  # the admission verdict, or text the detokenizer holds back
                    if (choice := shape.delta_choice(reply)) is not None and new:
                        yield _event(shape.chunk([choice]), resume.event_id(rid, reply.seq))
                elif isinstance(reply, protocol.Done):
                    lease.finished(_usage(reply))
                    if include_usage and new:
                        yield _event(shape.chunk([], usage=lease.usage), resume.event_id(rid, reply.seq))
                    if (past := resume.past_the_end(after, reply.seq)) is not None:
                        yield _event(past.to_openai(), resume.event_id(rid, reply.seq))
        except KvgateError as exc:
            lease.failed(exc.status)
            yield _event(exc.to_openai(), resume.event_id(rid, answer.handle.last_seq))
        yield b"data: [DONE]\n\n"
    finally:
        replies.cancel()
        answer.handle.close("client_disconnected")


async def _model_card(state: GatewayState, name: str, lease: Lease) -> dict:
    """`max_model_len` (vLLM's field): the smallest among the live workers of the version this key
    would be routed to now (None while none of them says); `chat_markers`: its chat template as role
    markers, for clients that write a chat as text (kvgate.lang; None: the template has none)."""
    version = await state.router.version_for(name, lease.key)
    facts = await state.registry.facts(name, version)
    return {"id": name, "object": "model", "created": 0, "owned_by": "kvgate",
            "max_model_len": facts.max_model_len, "chat_markers": facts.chat_markers}
