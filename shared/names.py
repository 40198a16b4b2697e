"""Every Redis key and channel name, defined once. All keys share the `kvgate:` prefix."""
from __future__ import annotations

PREFIX = "kvgate"
DEFAULT_LANE = "interactive"
BATCH_LANE = "batch"
CONSUMER_GROUP = "workers"


def request_stream(model: str, version: str, lane: str = DEFAULT_LANE) -> str:
    """The stream a gateway XADDs to and the workers of (model, version) consume."""
    return f"{PREFIX}:req:{model}:{version}:{lane}"


def reply_channel(gateway_id: str) -> str:
    """Pub/sub channel a gateway process listens on for the deltas of its own requests."""
    return f"{PREFIX}:reply:{gateway_id}"


CANCEL_CHANNEL = f"{PREFIX}:cancel"


def cancelled_key(request_id: str) -> str:
    """Marker (with TTL) so a cancel that arrives before any worker picked the entry still counts."""
    return f"{PREFIX}:cancelled:{request_id}"


WORKERS_ZSET = f"{PREFIX}:workers"


def worker_key(worker_id: str) -> str:
    """A worker's registry entry (JSON, with a TTL refreshed by its heartbeat)."""
    return f"{PREFIX}:worker:{worker_id}"


def model_versions_key(served_name: str) -> str:
    """Hash version → info of every version ever served under a name (bounded by versions)."""
    return f"{PREFIX}:model:{served_name}"
