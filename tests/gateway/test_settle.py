"""A request's settlement (gateway/holdings.py) on a real Redis: the one script a single Redis runs
(gateway/limits.py SETTLE) leaves exactly what the step-by-step path a cluster takes leaves —
tokens replaced by what was charged, usage counted (or an error), the slot given back."""
from __future__ import annotations

import time

import pytest

from gateway import holdings
from gateway.holdings import Holdings
from gateway.limits import Limits, Reservation
from shared import names
from shared.settings import GatewaySettings
from shared.usage import UsageBook, utc_day

USAGE = {"prompt_tokens": 30, "completion_tokens": 9, "total_tokens": 39}


async def _state(client, key_id: str) -> dict:
    """Everything a settlement touches for `key_id`, with the key id taken out of the names."""
    day = utc_day()
    return {
        "day_tokens": await client.get(names.daily_tokens_key(key_id, day)),
        "minute_tokens": sum(int(v) for v in (await client.hgetall(names.tpm_key(key_id))).values()),
        "usage": await client.hgetall(names.usage_key(key_id, day)),
        "indexed": await client.sismember(names.usage_day_index(day), key_id),
        "to_fold": await client.zscore(names.USAGE_DAYS_TO_FOLD, day) is not None,
        "in_flight": await client.zrange(names.inflight_key(key_id), 0, -1),
    }


async def _held(client, key_id: str, reserved: bool, version: str | None) -> Holdings:
    """A request as admission leaves it: its slot taken, its estimate charged to minute and day."""
    now = int(time.time())
    await client.zadd(names.inflight_key(key_id), {"slot-1": now + 600, "slot-2": now + 600})
    reservation = None
    if reserved:
        reservation = Reservation(key_id, now, utc_day(), 100)
        await client.hset(names.tpm_key(key_id), str(now), 100)
        await client.set(names.daily_tokens_key(key_id, utc_day()), 100)
    return Holdings(key_id, "slot-1", reservation, "demo" if version else None, version)


@pytest.mark.parametrize("usage, refused, reserved, version", [
    (USAGE, False, True, "v1"),  # finished: 100 reserved replaced by 39
    (None, False, True, "v1"),  # an error after its first token: the reservation stands, an error
    (None, True, True, "v1"),  # refused by its worker: nothing charged, an error counted
    (None, False, True, None),  # never dispatched: refunded, no usage
    (None, False, False, None),  # refused before any reservation: only the slot
])
async def test_one_script_settles_as_the_steps_do(aredis, usage, refused, reserved, version):
    limits, book = Limits(aredis, GatewaySettings(secret="s")), UsageBook(aredis, 30)
    at_once = await _held(aredis, "k-once", reserved, version)
    in_steps = await _held(aredis, "k-steps", reserved, version)
    await holdings._at_once(limits, book, at_once, usage, refused)
    await holdings._in_steps(limits, book, in_steps, usage, refused)
    once, steps = await _state(aredis, "k-once"), await _state(aredis, "k-steps")
    assert once == steps
    assert once["in_flight"] == [b"slot-2"]  # its own slot only
    if version is not None:
        assert once["usage"][b"demo|v1|requests"] == b"1" and once["indexed"] and once["to_fold"]
    else:
        assert once["usage"] == {} and not once["indexed"]
    if reserved:
        charged = at_once.charged(usage, refused)
        assert int(once["day_tokens"]) == charged == once["minute_tokens"]
