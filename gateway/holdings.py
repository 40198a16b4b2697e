"""What an admitted request holds until it is settled: one of its key's slots in flight, tokens
reserved on its key's minute and day, and usage to record for its (model, version). Settled in one
place whoever settles it: the gateway that admitted it (gateway/admission.py) or, for a stream that
outlived its gateway or its client, whichever gateway claims it (gateway/stream_leases.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from redis.exceptions import NoScriptError

from gateway.limits import Limits, Reservation
from shared import names
from shared.redis_client import is_cluster
from shared.usage import UsageBook

log = logging.getLogger("kvgate.gateway")


@dataclass(frozen=True)
class Holdings:
    key_id: str
    slot_id: str | None  # None: the key has no cap on requests in flight
    reservation: Reservation | None  # None: no token reserved (the request never got that far)
    model: str | None = None
    version: str | None = None  # None: never dispatched, so no usage to record

    def fields(self) -> dict[str, str]:
        """As a Redis hash's fields (see `from_fields`)."""
        out = {"key_id": self.key_id, "slot_id": self.slot_id or "", "model": self.model or "",
               "version": self.version or ""}
        if self.reservation is not None:
            r = self.reservation
            out |= {"bucket": str(r.bucket), "day": r.day, "estimate": str(r.estimate)}
        return out

    @classmethod
    def from_fields(cls, f: dict[str, str]) -> Holdings:
        reservation = (Reservation(f["key_id"], int(f["bucket"]), f["day"], int(f["estimate"]))
                       if "estimate" in f else None)
        return cls(f["key_id"], f.get("slot_id") or None, reservation, f.get("model") or None,
                   f.get("version") or None)

    def charged(self, usage: dict | None, refused: bool) -> int:
        """Tokens to charge: the actual ones when the request finished; none if the worker refused
        it before any token; else the reservation stands (a client that leaves is not refunded)."""
        if usage is not None:
            return usage["total_tokens"]
        if self.version is None or self.reservation is None or refused:
            return 0
        return self.reservation.estimate


async def settle(limits: Limits, book: UsageBook, held: Holdings, usage: dict | None,
                 refused: bool = False) -> None:
    """Tokens replaced by what was charged, usage recorded (None: an error), the slot freed.
    Redis trouble is logged, never raised: a served response must not turn into an error."""
    if is_cluster(limits.redis):  # the usage index is in other slots: one step at a time
        await _in_steps(limits, book, held, usage, refused)
        return
    try:
        await _at_once(limits, book, held, usage, refused)
    except Exception as exc:  # the slot frees itself at its expiry
        log.warning("could not settle usage of key %s: %s", held.key_id, type(exc).__name__)


async def _at_once(limits: Limits, book: UsageBook, held: Holdings, usage: dict | None,
                   refused: bool) -> None:
    """One Redis: the whole settlement in one transaction, one round trip."""
    charged = held.charged(usage, refused)
    pipe = limits.redis.pipeline(transaction=True)
    tokens = held.reservation is not None and limits.queue_settle(pipe, held.reservation, charged)
    if held.version is not None:
        book.queue(pipe, held.key_id, held.model, held.version, usage)
    if held.slot_id is not None:
        pipe.zrem(names.inflight_key(held.key_id), held.slot_id)
    if not len(pipe):
        return
    results = await pipe.execute(raise_on_error=False)
    if tokens and isinstance(results[0], NoScriptError):  # a Redis that lost its scripts (a
        await limits.settle_tokens(held.reservation, charged)  # restart): once more, loading it
    elif failed := [r for r in results if isinstance(r, Exception)]:
        log.warning("could not settle usage of key %s: %s", held.key_id, type(failed[0]).__name__)


async def _in_steps(limits: Limits, book: UsageBook, held: Holdings, usage: dict | None,
                    refused: bool) -> None:
    try:
        if held.reservation is not None:
            await limits.settle_tokens(held.reservation, held.charged(usage, refused))
        if held.version is not None:
            await book.record(held.key_id, held.model, held.version, usage)
    except Exception as exc:
        log.warning("could not settle usage of key %s: %s", held.key_id, type(exc).__name__)
    finally:
        if held.slot_id is not None:
            try:  # limits.release_slot by key id: the settler may not have the key's record
                await limits.redis.zrem(names.inflight_key(held.key_id), held.slot_id)
            except Exception as exc:  # a read-only Redis: the slot frees itself at its expiry
                log.warning("could not release a slot of key %s: %s", held.key_id, type(exc).__name__)
