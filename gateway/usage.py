"""Usage per key, UTC day, model and version: requests, prompt and completion tokens, errors.

Tokens are exactly the `usage` the client received (the worker's Done message). A request that
ended without one (an error, a timeout, a client that left) counts as a request and an error.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Literal

import redis.asyncio as aioredis

from gateway.limits import utc_day
from shared import names

COUNTERS = ("requests", "prompt_tokens", "completion_tokens", "errors")
GroupBy = Literal["model", "day", "key"]


class UsageBook:
    def __init__(self, redis: aioredis.Redis, retention_days: int):
        self.redis = redis
        self.ttl_s = retention_days * 86400

    async def record(self, key_id: str, model: str, version: str, usage: dict | None) -> None:
        day = utc_day()
        field = f"{model}|{version}|"
        pipe = self.redis.pipeline(transaction=True)
        pipe.hincrby(names.usage_key(key_id, day), field + "requests", 1)
        if usage is None:
            pipe.hincrby(names.usage_key(key_id, day), field + "errors", 1)
        else:
            pipe.hincrby(names.usage_key(key_id, day), field + "prompt_tokens", usage["prompt_tokens"])
            pipe.hincrby(names.usage_key(key_id, day), field + "completion_tokens",
                         usage["completion_tokens"])
        pipe.expire(names.usage_key(key_id, day), self.ttl_s)
        pipe.sadd(names.usage_day_index(day), key_id)
        pipe.expire(names.usage_day_index(day), self.ttl_s)
        await pipe.execute()

    async def query(self, since: float, key_id: str | None, by: GroupBy) -> list[dict]:
        """Rows of counters since `since` (whole UTC days), grouped by model+version, day or key."""
        rows: dict[tuple, dict] = defaultdict(lambda: dict.fromkeys(COUNTERS, 0))
        for day in _days(since):
            key_ids = [key_id] if key_id else sorted(
                k.decode() for k in await self.redis.smembers(names.usage_day_index(day)))
            for kid in key_ids:
                for field, value in (await self.redis.hgetall(names.usage_key(kid, day))).items():
                    model, version, counter = field.decode().rsplit("|", 2)
                    group = {"model": (model, version), "day": (day,), "key": (kid,)}[by]
                    rows[group][counter] += int(value)
        return [{**_group_fields(by, group), **counts,
                 "total_tokens": counts["prompt_tokens"] + counts["completion_tokens"]}
                for group, counts in sorted(rows.items())]


def _days(since: float) -> list[str]:
    """The UTC days from the one holding `since` through today."""
    days, t, today = [], since, utc_day()
    while (day := utc_day(t)) <= today:
        days.append(day)
        t += 86400
    if today not in days:
        days.append(today)
    return days


def _group_fields(by: GroupBy, group: tuple) -> dict:
    if by == "model":
        return {"model": group[0], "version": group[1]}
    if by == "day":
        return {"day": group[0]}
    return {"key_id": group[0]}


def since_time(seconds: int) -> float:
    return time.time() - seconds
