"""Admission to /v1: key → requests per minute → a slot in flight; what was taken is given back
(slot released, tokens settled, usage recorded) when the response has ended, whatever ended it.
"""
from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from gateway.auth import CurrentKey
from gateway.deps import StateDep
from gateway.dispatch import Handle
from gateway.keys import KeyRecord
from gateway.limits import Reservation
from gateway.routing import Outcome
from gateway.state import GatewayState
from shared import names
from shared.telemetry import tracer

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

    def reserved(self, reservation: Reservation) -> None:
        """Tokens were charged to the key's minute and day (settled at the end)."""
        self.reservation = reservation

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

    def charged_tokens(self) -> int:
        """Actual tokens when the request finished; nothing if it never reached a worker or the
        worker refused it before producing a token; else the reservation stands (a client that
        leaves mid-stream is not refunded)."""
        if self.usage is not None:
            return self.usage["total_tokens"]
        if self.version is None or self.reservation is None or (self.handle and self.handle.refused):
            return 0
        return self.reservation.estimate


def set_ratelimit_headers(request: Request, headers: dict[str, str]) -> None:
    """Headers the RateLimitHeaders middleware puts on this request's response."""
    current = getattr(request.state, "ratelimit_headers", {})
    request.state.ratelimit_headers = {**current, **headers}


def _lane(request: Request) -> str:
    return getattr(request.state, "lane", names.DEFAULT_LANE)  # set by authenticate


async def admit(request: Request, key: CurrentKey, state: StateDep) -> AsyncIterator[Lease]:
    limits = state.limits
    with tracer().start_as_current_span("limits"):
        set_ratelimit_headers(request, await limits.token_window(key))
        set_ratelimit_headers(request, await limits.count_request(key))
        lease = Lease(key=key, slot_id=secrets.token_hex(8), lane=_lane(request))
        lease.slot = await limits.acquire_slot(key, lease.slot_id)
    request.state.lease = lease  # for the metrics and the access line (gateway/observe.py)
    try:
        yield lease
    finally:
        await settle(state, lease)


async def settle(state: GatewayState, lease: Lease) -> None:
    try:
        if lease.reservation is not None:
            await state.limits.settle_tokens(lease.reservation, lease.charged_tokens())
        if lease.version is not None:
            await state.usage.record(lease.key.id, lease.model, lease.version, lease.usage)
        if lease.outcome is not None:
            await state.router.record(lease.outcome)
    except Exception as exc:  # Redis trouble must not turn a served response into an error
        log.warning("could not settle usage of key %s: %s", lease.key.id, type(exc).__name__)
    finally:
        if lease.slot:
            try:
                await state.limits.release_slot(lease.key, lease.slot_id)
            except Exception as exc:  # a read-only Redis: the slot frees itself at its expiry
                log.warning("could not release a slot of key %s: %s", lease.key.id, type(exc).__name__)


Admitted = Annotated[Lease, Depends(admit)]
