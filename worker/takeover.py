"""Takeover: claim the pending entries of workers whose heartbeat lapsed, so no request is lost.

XPENDING lists who owns what and for how long; only entries idle longer than the heartbeat TTL
whose owner has no live registry entry are claimed (XCLAIM), so a live worker's long request is
never stolen just because it has been running for a while. A worker also takes back entries
pending under its own name that it does not know: Redis delivered them, but the answer to that
read was lost (the connection broke mid-pipeline), so nobody else would ever serve them.
"""
from __future__ import annotations

import redis

from shared import names, protocol


def claim_orphans(client: redis.Redis, stream: str, me: str, min_idle_ms: int, count: int,
                  known: set[bytes] = frozenset()) -> list[tuple[bytes, bytes]]:
    """Up to `count` entries idle past `min_idle_ms` whose owner is dead, or that are pending
    under `me` but not among the entry ids `known` to me (in the engine or waiting to be)."""
    if count <= 0:
        return []
    pending = client.xpending_range(stream, names.CONSUMER_GROUP, min="-", max="+",
                                    count=max(count * 4, 32), idle=min_idle_ms)
    owners = {p["consumer"] for p in pending if _name(p["consumer"]) != me}
    dead = {o for o in owners if not client.exists(names.worker_key(_name(o)))}
    lost = {p["message_id"] for p in pending
            if _name(p["consumer"]) == me and p["message_id"] not in known}
    ids = [p["message_id"] for p in pending if p["consumer"] in dead or p["message_id"] in lost][:count]
    if not ids:
        return []
    claimed = client.xclaim(stream, names.CONSUMER_GROUP, me, min_idle_time=min_idle_ms,
                            message_ids=ids)
    return [(entry_id, fields[protocol.ENTRY_FIELD]) for entry_id, fields in claimed
            if fields and protocol.ENTRY_FIELD in fields]


def _name(consumer: bytes | str) -> str:
    return consumer.decode() if isinstance(consumer, bytes) else consumer
