"""Which served names exist, which workers are live, and which version a request goes to."""
from __future__ import annotations

import time
from dataclasses import dataclass

import orjson
import redis.asyncio as aioredis

from shared import names, redis_client
from shared.errors import NotFound, Overloaded


@dataclass(frozen=True)
class Facts:
    """What the live workers of one (name, version) say about their model: the smallest of each
    (a rolling upgrade may mix workers), None where no worker says (an older worker)."""

    max_model_len: int | None = None
    vocab_size: int | None = None
    schema: int | None = None  # the protocol schema to write entries in (None: the oldest, 1)
    tool_call_parser: str | None = None  # the family parser of tool calls, when every worker names the same
    chat_markers: dict | None = None  # the chat template as role markers (worker/engine/chat_markers.py)
    task: str | None = None  # "generate", "embed" or "score" when every worker says the same (an older worker: generate)


def _info(raw: bytes | None) -> dict | None:
    """A registry entry, or None for one this gateway cannot use (gone, not JSON, or without the
    name and version a worker of any release writes): one odd entry must not fail every request."""
    try:
        info = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        return None
    if not isinstance(info, dict) or not all(isinstance(info.get(k), str) for k in ("served_name", "version")):
        return None
    return info


def _agreed(workers: list[dict], field: str) -> str | None:
    """The value every worker gives (None if one differs, or says nothing: an older worker)."""
    values = {w.get(field) for w in workers}
    value = values.pop() if len(values) == 1 else None
    return value if isinstance(value, str) else None


def _same_dict(workers: list[dict], field: str) -> dict | None:
    """The mapping every worker gives (None if one differs or says nothing)."""
    values = [w.get(field) for w in workers]
    return values[0] if values and isinstance(values[0], dict) and all(v == values[0] for v in values) else None


def _smallest(workers: list[dict], field: str) -> int | None:
    values = [w[field] for w in workers if isinstance(w.get(field), int)]
    return min(values) if values else None


class Registry:
    """Reads the worker registry from Redis, cached for a fraction of a second per process."""

    def __init__(self, redis: aioredis.Redis, cache_s: float = 0.5):
        self.redis = redis
        self.cache_s = cache_s
        self._workers: list[dict] = []
        self._fetched = 0.0
        self._seen: set[str] = set()  # names this process has seen served: never 404 after a Redis loss

    async def live_workers(self) -> list[dict]:
        if time.monotonic() - self._fetched < self.cache_s:
            return self._workers
        ids = await self.redis.zrangebyscore(names.WORKERS_ZSET, time.time(), "+inf")
        infos = await redis_client.mget(self.redis, [names.worker_key(i.decode()) for i in ids])
        self._workers = [w for w in map(_info, infos) if w is not None]
        self._seen.update(w["served_name"] for w in self._workers)
        self._fetched = time.monotonic()
        return self._workers

    async def live_names(self) -> list[str]:
        return sorted({w["served_name"] for w in await self.live_workers()})

    async def route(self, served_name: str) -> str:
        """The version to serve `served_name` from: 404 if never served, 503 if none is live."""
        live = sorted({w["version"] for w in await self.live_workers()
                       if w["served_name"] == served_name})
        if live:
            return live[-1]
        if served_name not in self._seen and not await self.redis.exists(
                names.model_versions_key(served_name)):
            raise NotFound(f"The model '{served_name}' does not exist", param="model")
        raise Overloaded(f"No live worker serves '{served_name}' right now; retry shortly",
                         param="model", retry_after=2)

    async def facts(self, served_name: str, version: str) -> Facts:
        workers = [w for w in await self.live_workers()
                   if w["served_name"] == served_name and w["version"] == version]
        schema = 1 if any("schema" not in w for w in workers) else _smallest(workers, "schema")
        return Facts(_smallest(workers, "max_model_len"), _smallest(workers, "vocab_size"), schema,
                     _agreed(workers, "tool_call_parser"), _same_dict(workers, "chat_markers"),
                     _agreed([{"task": "generate", **w} for w in workers], "task"))
