"""What an admitted request holds until it is settled: one of its key's slots in flight, tokens
reserved on its key's minute and day, and usage to record for its (model, version). Settled in one
place whoever settles it: the gateway that admitted it (gateway/admission.py) or, for a stream that
outlived its gateway or its client, whichever gateway claims it (gateway/stream_leases.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from gateway.limits import Limits, Reservation
from shared import names
from shared.redis_client import is_cluster
from shared.usage import UsageBook, utc_day

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


def settle_call(book: UsageBook, held: Holdings, usage: dict | None,
                refused: bool) -> tuple[list[str], list] | None:
    """The keys and arguments of gateway/limits.py SETTLE_FN for these holdings; None when there
    is nothing to settle."""
    r, charged = held.reservation, held.charged(usage, refused)
    delta = charged - r.estimate if r is not None else 0
    if not delta and held.version is None and held.slot_id is None:
        return None
    day = r.day if r is not None else utc_day()
    keys = [names.tpm_key(held.key_id), names.daily_tokens_key(held.key_id, day)]
    args = [r.bucket if r is not None else 0, delta or ""]
    if held.version is not None:
        usage_keys, usage_args = book.count_call(held.key_id, held.model, held.version, usage)
    else:  # never dispatched: no usage (the keys are named, not touched)
        usage_keys = [names.usage_day_index(day), names.USAGE_DAYS_TO_FOLD, names.usage_key(held.key_id, day)]
        usage_args = ["", "", "", "", "", "", ""]
    keys += usage_keys + [names.inflight_key(held.key_id)]
    return keys, args + usage_args + [held.slot_id or ""]


async def _at_once(limits: Limits, book: UsageBook, held: Holdings, usage: dict | None,
                   refused: bool) -> None:
    """One Redis: the whole settlement in one script, one round trip."""
    if (call := settle_call(book, held, usage, refused)) is not None:
        await limits.settle(*call)


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
