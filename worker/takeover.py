"""Takeover: claim the pending entries of workers whose heartbeat lapsed, so no request is lost.

XPENDING lists who owns what and for how long; only entries idle longer than the heartbeat TTL
whose owner has no live registry entry are claimed (XCLAIM), so a live worker's long request is
never stolen just because it has been running for a while. A worker also takes back entries
pending under its own name that it does not know: Redis delivered them, but the answer to that
read was lost (the connection broke mid-pipeline), so nobody else would ever serve them.

Each claimed entry comes with XPENDING's delivery count from before the claim: how many times
workers were handed it. The service answers one delivered `KVGATE_MAX_DELIVERIES` times with an
error instead of running it (the poison cap), so an entry that crashes every worker that takes it
takes down at most that many, never the fleet.
"""
from __future__ import annotations

from typing import NamedTuple

import redis

from shared import names, protocol


class Orphan(NamedTuple):
    entry_id: bytes
    raw: bytes
    times_delivered: int  # before this claim


def claim_orphans(client: redis.Redis, stream: str, me: str, min_idle_ms: int, count: int,
                  known: set[bytes] = frozenset()) -> list[Orphan]:
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
    chosen = [p for p in pending if p["consumer"] in dead or p["message_id"] in lost][:count]
    if not chosen:
        return []
    delivered = {p["message_id"]: p["times_delivered"] for p in chosen}
    claimed = client.xclaim(stream, names.CONSUMER_GROUP, me, min_idle_time=min_idle_ms,
                            message_ids=list(delivered))
    # an entry deleted meanwhile (no fields) or not ours (no entry field) comes back empty, so the
    # service acknowledges it rather than leave it pending under this worker for good
    return [Orphan(entry_id, (fields or {}).get(protocol.ENTRY_FIELD, b""), delivered[entry_id])
            for entry_id, fields in claimed]


def _name(consumer: bytes | str) -> str:
    return consumer.decode() if isinstance(consumer, bytes) else consumer
