"""Admission to /v1: key → requests per minute → a slot in flight; what was taken is given back
(slot released, tokens settled, usage recorded) when the response has ended, whatever ended it.

A generation (GENERATING: the routes that reach `open_answer`, and /v1/embeddings) is admitted there instead, once its
body is parsed and routed: its minute, its slot and its tokens in one round trip (gateway/limits.py
ADMIT), so a request costs a key lookup and one script before its XADD. Such a request refused
before then for what it said (a bad body, a model it may not use, a prompt past the context) takes
one request of its key's minute afterwards, as every other route's request does.
"""
from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError

from gateway.auth import CurrentKey
from gateway.deps import state_of
from gateway import holdings, timeouts
from gateway.dispatch import Handle
from gateway.holdings import Holdings
from gateway.keys import KeyRecord
from gateway.limits import Admission, Limits, Reservation
from gateway.routing import Outcome
from gateway.state import GatewayState
from gateway.stream_leases import ABANDONED, StreamLease
from gateway.timeouts import Timeouts
from shared import names, telemetry
from shared.errors import KvgateError, RateLimited
from shared.redis_errors import REDIS_ERRORS

log = logging.getLogger("kvgate.gateway")


@dataclass
class Lease:
    """What one admitted request holds, and what it turned out to use. It moves on only through
    the methods below: reserved → dispatched → finished (usage) or failed (an error mid-stream)."""

    key: KeyRecord
    slot_id: str
    slot: bool = False
    lane: str = names.DEFAULT_LANE  # a batch line's token puts it in names.BATCH_LANE
    reservation: Reservation | None = None
    model: str | None = None
    version: str | None = None  # set once dispatched: from then on the request counts as usage
    handle: Handle | None = None  # its replies, once dispatched
    outcome: Outcome | None = None  # timings and ending, for the canary analysis
    usage: dict | None = None  # the `usage` the client received
    error_status: int | None = None  # the status of an error a stream ended with
    resuming: bool = False  # resumes a stream (Last-Event-ID): the original's slot and tokens stand
    deferred: bool = False  # a generation: its minute and slot are taken with its tokens (`admitted`)
    stream: StreamLease | None = None  # set once its holdings are in Redis: settled by claim, once
    unstarted: bool = False  # its stream's lease was written but the stream never began: no grace
    timeouts: Timeouts | None = None  # its time limits: the key's, its route's or the defaults

    def reserved(self, reservation: Reservation) -> None:
        """Tokens were charged to the key's minute and day (settled at the end)."""
        self.reservation = reservation

    def admitted(self, admission: Admission) -> None:
        """The key's limits let it through: what they took is its to give back."""
        self.slot = self.slot or admission.slot
        self.deferred = False
        if admission.reservation is not None:
            self.reserved(admission.reservation)

    def dispatched(self, model: str, handle: Handle, outcome: Outcome) -> None:
        """The request is on its version's stream: from now on it counts as usage."""
        self.model, self.version, self.handle = model, outcome.version, handle
        if self.lane == names.DEFAULT_LANE:  # batch lines wait behind by design: no canary signal
            self.outcome = outcome

    def finished(self, usage: dict) -> None:
        """The client received this `usage`: what is charged."""
        self.usage = usage

    def failed(self, status: int) -> None:
        """The stream ended with an error event of this status (its 200 had gone out)."""
        self.error_status = status

    def streamed(self, stream: StreamLease) -> None:
        """Its holdings are in Redis now: whichever gateway ends the stream settles them."""
        self.stream = stream

    def adopt(self, stream: StreamLease, held: Holdings, handle: Handle) -> None:
        """A resume took the stream over: this lease settles the original's holdings at the end."""
        self.stream, self.handle = stream, handle
        self.slot_id, self.slot = held.slot_id or "", held.slot_id is not None
        self.reservation, self.model, self.version = held.reservation, held.model, held.version

    def holdings(self) -> Holdings:
        """Usage goes to the version that answered: a retry before the first token may have moved
        the request off the one it was routed to (whose canary outcome still counts the failure)."""
        version = (self.handle.version if self.handle else None) or self.version
        return Holdings(self.key.id, self.slot_id if self.slot else None, self.reservation,
                        self.model, version)

    def refused(self) -> bool:
        return bool(self.handle and self.handle.refused)

    def ended(self) -> bool:
        """The client saw the stream's end: its usage, or an error."""
        return self.usage is not None or self.error_status is not None

    def charged_tokens(self) -> int:
        """Actual tokens when the request finished; nothing if it never reached a worker or the
        worker refused it before producing a token; else the reservation stands (a client that
        leaves mid-stream is not refunded)."""
        return self.holdings().charged(self.usage, self.refused())


def set_ratelimit_headers(request: Request, headers: dict[str, str]) -> None:
    """Headers the RateLimitHeaders middleware puts on this request's response."""
    current = getattr(request.state, "ratelimit_headers", {})
    request.state.ratelimit_headers = {**current, **headers}


def _lane(request: Request) -> str:
    return getattr(request.state, "lane", names.DEFAULT_LANE)  # set by authenticate


def resumes(request: Request) -> bool:
    """A stream resumed by its client (Last-Event-ID on a streaming route, or /v1/streams): the
    same request again, so it takes no new request of the minute and no new slot."""
    path = request.url.path
    return path.startswith(RESUME_PREFIX) or (
        "last-event-id" in request.headers and path in RESUMABLE_PATHS)


RESUMABLE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})
RESUME_PREFIX = "/v1/streams/"
SCORING = frozenset({"/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank"})
GENERATING = RESUMABLE_PATHS | {"/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/v1/embeddings"} | SCORING


def _deferred(request: Request, lease: Lease) -> bool:
    """A generation is admitted with its tokens, in `open_answer` (one script, not two)."""
    return request.method == "POST" and request.url.path in GENERATING and not lease.resuming


async def admit(request: Request, key: CurrentKey) -> AsyncIterator[Lease]:
    state = state_of(request)
    limits = state.limits
    lease = Lease(key=key, slot_id=secrets.token_hex(8), lane=_lane(request), resuming=resumes(request))
    lease.timeouts = timeouts.of(state.settings, key, request.url.path, lease.lane)
    lease.deferred = _deferred(request, lease)
    with telemetry.span("limits"):
        if not lease.deferred:  # one round trip: the token window, and unless it resumes, the
            # request counted in its minute and a slot taken
            taken = None if lease.resuming else lease.slot_id
            admission = await limits.admit(key, count=taken is not None, slot_id=taken,
                                           total_s=lease.timeouts.total_s)
            lease.admitted(admission)
            set_ratelimit_headers(request, admission.headers)
    request.state.lease = lease  # for the metrics and the access line (gateway/observe.py)
    try:
        yield lease
    except Exception as exc:
        if lease.deferred and _callers_fault(exc):
            await _count_refused(limits, lease)
        raise
    finally:
        await settle(state, lease)


def _callers_fault(exc: Exception) -> bool:
    """A refusal for what the request said (its body, its model, its context), not the gateway's
    state (a 5xx) or a limit (a 429, counted by ADMIT where it was one)."""
    if isinstance(exc, RequestValidationError):
        return True
    return isinstance(exc, KvgateError) and 400 <= exc.status < 500 and exc.status != 429


async def _count_refused(limits: Limits, lease: Lease) -> None:
    """A generation refused before its admission still takes one request of its key's minute, as
    every other route's does: its body was parsed and checked (~30 ms of the event loop for a MiB
    of messages), and uncounted, a key could have the gateway check invalid bodies as fast as it
    sent them. Past the limit the key is known full (gateway/limits.py FullMinutes) and its next
    bodies are refused unread."""
    try:
        await limits.admit(lease.key, count=True)
    except RateLimited:
        pass
    except REDIS_ERRORS as exc:  # the refusal stands; only its count is lost
        log.warning("could not count a refused request of key %s: %s", lease.key.id, type(exc).__name__)


async def settle(state: GatewayState, lease: Lease) -> None:
    """What the request holds, given back once: here, unless its holdings went to Redis with its
    stream and another gateway settles them (or will, if its client comes back there)."""
    if lease.stream is None:
        await holdings.settle(state.limits, state.usage, lease.holdings(), lease.usage, lease.refused())
    else:
        await _end_stream(state, lease)
    if lease.outcome is not None:
        try:
            await state.router.record(lease.outcome)
        except Exception as exc:  # Redis trouble must not turn a served response into an error
            log.warning("could not record the outcome of key %s: %s", lease.key.id, type(exc).__name__)


async def _end_stream(state: GatewayState, lease: Lease) -> None:
    """A stream's holdings settled here if this gateway saw its end, or its client left and there
    is no grace (claimed and settled in one round trip); a client that left within a grace is let
    go (a resume may come back)."""
    streams = state.streams
    try:
        if not lease.ended() and streams.grace_s > 0 and not lease.unstarted:
            await streams.let_go(lease.stream)
            return
        as_ = "done" if lease.usage is not None else "error" if lease.ended() else ABANDONED
        await streams.end(lease.stream, as_, lease.holdings(), lease.usage, lease.refused())
    except Exception as exc:  # its hold lapses, and a sweeper settles it from the reply log
        log.warning("could not settle stream %s here: %s", lease.stream.request_id, type(exc).__name__)


Admitted = Annotated[Lease, Depends(admit)]
