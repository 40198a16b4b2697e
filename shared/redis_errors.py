"""Which Redis errors mean "Redis refuses for now, retry shortly", in words a client can read.

Redis refuses commands for a while when it is full (OOM under `maxmemory` with `noeviction`), a
replica (READONLY, e.g. during a failover), unable to save (MISCONF), loading its data (LOADING),
stuck in a script (BUSY) or unreachable. Every process waits these out instead of failing: the
worker keeps its replies and retries, the gateway answers 503 with Retry-After. Any other error
(NOGROUP, WRONGTYPE, a bad argument) will not go away by waiting.
"""
from __future__ import annotations

import re

import redis
from redis import exceptions

# Reply codes of a temporary refusal, and what they mean to a client. A script's error carries the
# code inside its text ("... -OOM command not allowed ..."), so the text is searched, not only the type.
REFUSALS = {
    "OOM": "Redis is out of memory (maxmemory)",
    "READONLY": "Redis is read-only (a replica, e.g. during a failover)",
    "MISCONF": "Redis cannot save to disk and refuses writes (MISCONF)",
    "LOADING": "Redis is loading its data set",
    "BUSY": "Redis is busy running a script",
    "MASTERDOWN": "Redis's primary is down",
    "NOREPLICAS": "Redis has too few replicas to accept writes",
    "TRYAGAIN": "Redis asked to try again (a cluster slot is moving)",
    "CLUSTERDOWN": "the Redis cluster is down",
}
FAILING_OVER = "the Redis cluster is failing over (a slot has no reachable primary yet)"
_BY_TYPE = ((exceptions.OutOfMemoryError, REFUSALS["OOM"]),
            (exceptions.ReadOnlyError, REFUSALS["READONLY"]),
            (exceptions.BusyLoadingError, REFUSALS["LOADING"]),
            (exceptions.TryAgainError, REFUSALS["TRYAGAIN"]),
            (exceptions.MasterDownError, REFUSALS["MASTERDOWN"]),
            (exceptions.ClusterDownError, REFUSALS["CLUSTERDOWN"]),
            # redirections that never settled ("TTL exhausted"), a slot no node serves yet
            (exceptions.ClusterError, FAILING_OVER), (exceptions.SlotNotCoveredError, FAILING_OVER))
_CODE = re.compile(r"(?<!\w)(" + "|".join(REFUSALS) + r")\b")

# What a Redis outage may raise: redis-py's cluster client raises some errors (no node reachable, a
# slot not covered during a failover) that are not RedisError. Catch this, not RedisError alone.
REDIS_ERRORS = (redis.RedisError, exceptions.RedisClusterException)
# Redis is unreachable: no connection, or no node of a cluster answered (redis-py 8.2 raises its own
# subclass for that; before it, the base class with "cannot be connected" in its text, matched below)
_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError,
                *filter(None, [getattr(exceptions, "RedisClusterUnreachableError", None)]))


def refusal(exc: BaseException) -> str | None:
    """Why Redis refused, when retrying later may succeed; None for an error waiting will not fix."""
    for kind, why in _BY_TYPE:  # redis-py strips the code from the text of these
        if isinstance(exc, kind):
            return why
    if isinstance(exc, (exceptions.AuthenticationError, exceptions.AuthorizationError)):
        return "Redis refused this process's credentials (check KVGATE_REDIS_URL)"
    if isinstance(exc, _UNREACHABLE) or (  # the base class's other uses are bugs: cross-slot, unsupported
            type(exc) is exceptions.RedisClusterException and "cannot be connected" in str(exc)):
        return "Redis is unreachable"
    # a pipeline's error names its command first ("Command # 1 (SET k v) of pipeline caused error: ")
    text = str(exc).split("caused error: ", 1)[-1]
    if isinstance(exc, redis.ResponseError) and (match := _CODE.search(text)):
        return REFUSALS[match.group(1)]
    return None
