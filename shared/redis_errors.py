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
_BY_TYPE = ((redis.exceptions.OutOfMemoryError, "OOM"), (redis.exceptions.ReadOnlyError, "READONLY"),
            (redis.exceptions.BusyLoadingError, "LOADING"), (redis.exceptions.TryAgainError, "TRYAGAIN"),
            (redis.exceptions.MasterDownError, "MASTERDOWN"),
            (redis.exceptions.ClusterDownError, "CLUSTERDOWN"))
_CODE = re.compile(r"(?<!\w)(" + "|".join(REFUSALS) + r")\b")


def refusal(exc: BaseException) -> str | None:
    """Why Redis refused, when retrying later may succeed; None for an error waiting will not fix."""
    for kind, code in _BY_TYPE:  # redis-py strips the code from the text of these
        if isinstance(exc, kind):
            return REFUSALS[code]
    if isinstance(exc, (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError)):
        return "Redis refused this process's credentials (check KVGATE_REDIS_URL)"
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return "Redis is unreachable"
    # a pipeline's error names its command first ("Command # 1 (SET k v) of pipeline caused error: ")
    text = str(exc).split("caused error: ", 1)[-1]
    if isinstance(exc, redis.ResponseError) and (match := _CODE.search(text)):
        return REFUSALS[match.group(1)]
    return None
