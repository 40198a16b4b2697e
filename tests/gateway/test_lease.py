"""A Lease moves only through its transitions, and what it charges follows where it got to."""
from __future__ import annotations

import asyncio

from gateway.admission import Lease
from gateway.dispatch import Handle
from gateway.keys import bootstrap_record
from gateway.limits import Reservation
from gateway.routing import Outcome
from shared import names


def _lease(lane: str = names.DEFAULT_LANE) -> Lease:
    lease = Lease(key=bootstrap_record("dev", "user"), slot_id="s", lane=lane)
    lease.reserved(Reservation("dev", bucket=0, day="20260101", estimate=500))
    return lease


def _handle() -> Handle:
    return Handle(None, "cmpl-1", asyncio.Queue(), deadline=0.0)


def test_a_request_refused_before_dispatch_is_charged_nothing():
    lease = _lease()
    assert lease.version is None and lease.charged_tokens() == 0


def test_a_dispatched_request_counts_as_usage_and_keeps_its_reservation_until_it_finishes():
    lease = _lease()
    outcome = Outcome("chat", "v2", window_s=60)
    lease.dispatched("chat", _handle(), outcome)
    assert (lease.model, lease.version, lease.outcome) == ("chat", "v2", outcome)
    assert lease.charged_tokens() == 500  # a client that leaves mid-stream is not refunded
    lease.finished({"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10})
    assert lease.charged_tokens() == 10


def test_a_batch_line_gives_the_canary_analysis_no_outcome():
    lease = _lease(names.BATCH_LANE)
    lease.dispatched("chat", _handle(), Outcome("chat", "v2", window_s=60))
    assert lease.version == "v2" and lease.outcome is None


def test_a_refusal_before_any_token_is_charged_nothing_and_a_failed_stream_keeps_its_status():
    lease = _lease()
    handle = _handle()
    lease.dispatched("chat", handle, Outcome("chat", "v1", window_s=None))
    handle.refused = True
    lease.failed(503)
    assert lease.charged_tokens() == 0 and lease.error_status == 503
