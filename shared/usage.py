"""Usage per key, UTC day, model and version: requests, prompt and completion tokens, errors.

Tokens are exactly the `usage` the client received (the worker's Done message). A request that
ended without one (an error, a timeout, a client that left) counts as a request and an error.

The gateway records into one hash per key and day. Once a day is over (and ROLLUP_GRACE_S more, for
gateways whose clocks lag), Celery beat folds that day's hashes into one roll-up hash, so a report
over many days and keys reads a hash per day rather than one per key per day. A record that arrives
for a folded day (a clock far behind) puts the day back in line and the next beat folds it again.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Literal

import redis.asyncio as aioredis

from shared import names
from shared.redis_client import is_cluster

COUNTERS = ("requests", "prompt_tokens", "completion_tokens", "errors")
GroupBy = Literal["model", "day", "key"]
ROLLUP_GRACE_S = 600
_DAY_S = 86400


# `record` in one Redis, as a Lua function a settlement script includes (gateway/holdings.py):
# the day indexed for its roll-up, then the counters; prompt '' counts an error.
COUNT_USAGE_FN = """
local function count_usage(index, fold, hash, key_id, day, fold_at, ttl, field, prompt, completion)
  redis.call('SADD', index, key_id)
  redis.call('EXPIRE', index, ttl)
  redis.call('ZADD', fold, 'NX', fold_at, day)
  redis.call('EXPIRE', fold, ttl)
  redis.call('HINCRBY', hash, field .. 'requests', 1)
  if prompt == '' then
    redis.call('HINCRBY', hash, field .. 'errors', 1)
  else
    redis.call('HINCRBY', hash, field .. 'prompt_tokens', prompt)
    redis.call('HINCRBY', hash, field .. 'completion_tokens', completion)
  end
  redis.call('EXPIRE', hash, ttl)
end
"""


def utc_day(t: float | None = None) -> str:
    return time.strftime("%Y%m%d", time.gmtime(time.time() if t is None else t))


class UsageBook:
    def __init__(self, redis: aioredis.Redis, retention_days: int):
        self.redis = redis
        self.ttl_s = retention_days * _DAY_S

    async def record(self, key_id: str, model: str, version: str, usage: dict | None,
                     now: float | None = None) -> None:
        now = time.time() if now is None else now
        day, field = utc_day(now), f"{model}|{version}|"
        hash_key = names.usage_key(key_id, day)
        cluster = is_cluster(self.redis)
        pipe = self.redis.pipeline(transaction=not cluster)
        # in line for its roll-up once over; a folded day that gets a late record is queued again
        pipe.sadd(names.usage_day_index(day), key_id)
        pipe.expire(names.usage_day_index(day), self.ttl_s)
        pipe.zadd(names.USAGE_DAYS_TO_FOLD, {day: now - now % _DAY_S + _DAY_S}, nx=True)
        pipe.expire(names.USAGE_DAYS_TO_FOLD, self.ttl_s)
        if cluster:  # three slots: the day is indexed before it is counted (a failure between
            await pipe.execute()  # leaves a day indexed with nothing to count, never the reverse)
            pipe = self.redis.pipeline(transaction=True)
        self._count(pipe, hash_key, field, usage)
        await pipe.execute()

    def count_call(self, key_id: str, model: str, version: str, usage: dict | None,
                   now: float | None = None) -> tuple[list[str], list]:
        """`record` as the keys and arguments of COUNT_USAGE_FN (one Redis, not a cluster), so that
        a request's settlement is one script (gateway/holdings.py); usage None: an error."""
        now = time.time() if now is None else now
        day = utc_day(now)
        keys = [names.usage_day_index(day), names.USAGE_DAYS_TO_FOLD, names.usage_key(key_id, day)]
        tokens = ["", ""] if usage is None else [usage["prompt_tokens"], usage["completion_tokens"]]
        return keys, [key_id, day, now - now % _DAY_S + _DAY_S, self.ttl_s, f"{model}|{version}|", *tokens]

    def _count(self, pipe, hash_key: str, field: str, usage: dict | None) -> None:
        pipe.hincrby(hash_key, field + "requests", 1)
        if usage is None:
            pipe.hincrby(hash_key, field + "errors", 1)
        else:
            pipe.hincrby(hash_key, field + "prompt_tokens", usage["prompt_tokens"])
            pipe.hincrby(hash_key, field + "completion_tokens", usage["completion_tokens"])
        pipe.expire(hash_key, self.ttl_s)

    def window_start(self, since: float, now: float | None = None) -> float:
        """`since`, or the oldest time the retention still keeps counters for if that is later:
        a report over an absurd span reads the retained days, not one empty day per day asked."""
        now = time.time() if now is None else now
        return max(since, now - self.ttl_s)

    async def query(self, since: float, key_id: str | None, by: GroupBy) -> list[dict]:
        """Rows of counters since `since` (whole UTC days, within the retention), grouped by
        model+version, day or key."""
        rows: dict[tuple, dict] = defaultdict(lambda: dict.fromkeys(COUNTERS, 0))
        for day in _days(self.window_start(since)):
            counts = None if key_id else await _folded(self.redis, day)
            if counts is None:
                counts = await _per_key(self.redis, day, key_id)
            for (kid, model, version, counter), value in counts.items():
                group = {"model": (model, version), "day": (day,), "key": (kid,)}[by]
                rows[group][counter] += value
        return [{**_group_fields(by, group), **counts,
                 "total_tokens": counts["prompt_tokens"] + counts["completion_tokens"]}
                for group, counts in sorted(rows.items())]


async def fold(redis: aioredis.Redis, now: float | None = None) -> list[str]:
    """Roll up every day that has been over for ROLLUP_GRACE_S; the days folded."""
    now = time.time() if now is None else now
    days = [d.decode() for d in await redis.zrangebyscore(
        names.USAGE_DAYS_TO_FOLD, "-inf", now - ROLLUP_GRACE_S)]
    for day in days:
        # out of line first: a record landing while this runs queues the day again
        await redis.zrem(names.USAGE_DAYS_TO_FOLD, day)
        try:
            counts = await _per_key(redis, day, None)
            ttl = await redis.ttl(names.usage_day_index(day))  # the roll-up lives as long as its sources
            pipe = redis.pipeline(transaction=True)
            pipe.delete(names.usage_rollup(day))
            if counts and ttl > 0:
                pipe.hset(names.usage_rollup(day), mapping={"|".join(k): v for k, v in counts.items()})
                pipe.expire(names.usage_rollup(day), ttl)
            await pipe.execute()
        except Exception:
            await redis.zadd(names.USAGE_DAYS_TO_FOLD, {day: 0}, nx=True)
            raise
    return days


async def _per_key(redis: aioredis.Redis, day: str, key_id: str | None) -> dict[tuple, int]:
    """(key id, model, version, counter) -> value, from the keys' own hashes of the day."""
    key_ids = [key_id] if key_id else sorted(
        k.decode() for k in await redis.smembers(names.usage_day_index(day)))
    counts: dict[tuple, int] = {}
    for kid in key_ids:
        for field, value in (await redis.hgetall(names.usage_key(kid, day))).items():
            model, version, counter = field.decode().rsplit("|", 2)
            counts[(kid, model, version, counter)] = int(value)
    return counts


async def _folded(redis: aioredis.Redis, day: str) -> dict[tuple, int] | None:
    """The same counts from the day's roll-up; None when the day has not been folded."""
    folded = await redis.hgetall(names.usage_rollup(day))
    if not folded:
        return None
    counts = {}
    for field, value in folded.items():
        kid, rest = field.decode().split("|", 1)  # key ids have no "|"; model names might
        counts[(kid, *rest.rsplit("|", 2))] = int(value)
    return counts


def _days(since: float) -> list[str]:
    """The UTC days from the one holding `since` through today."""
    days, t, today = [], since, utc_day()
    while (day := utc_day(t)) <= today:
        days.append(day)
        t += _DAY_S
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
