"""The registry: this worker's entry in Redis, written again every heartbeat with a TTL a few beats
long. Gateways read it (what the worker serves, its context and schema, its load and counts); live
workers leave the requests of a worker whose entry exists alone, and take over those of one whose
entry expired (worker/takeover.py). The served version joins the versions ever served under its
name, which outlive the worker (canary routes and the gateway's metrics name them).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import orjson
import redis

from shared import names
from shared.redis_errors import REDIS_ERRORS, refusal
from shared.settings import WorkerSettings

log = logging.getLogger("kvgate.worker")


class Heartbeat:
    def __init__(self, client: redis.Redis, s: WorkerSettings, stopping: threading.Event,
                 entry: Callable[[], dict]):
        """`entry`: the registry entry as it stands now (read on the heartbeat's thread)."""
        self.client, self.s, self.stopping, self.entry = client, s, stopping, entry

    def register_model(self) -> None:
        """At start-up: this version of the served name, from this model folder."""
        self.client.hset(*self._registration())
        self.client.sadd(names.SERVED_NAMES, self.s.served_name)

    def _registration(self) -> tuple[str, str, bytes]:
        """(hash, field, value) of this version's entry among the versions of its served name."""
        return (names.model_versions_key(self.s.served_name), self.s.version,
                orjson.dumps({"model": self.s.model, "registered": time.time()}))

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._loop, daemon=True, name="heartbeat")
        thread.start()
        return thread

    def _loop(self) -> None:
        failing = False  # log when heartbeats start and stop failing, not every beat
        while not self.stopping.is_set():
            try:
                self.beat()
                if failing:
                    log.info("heartbeat sent again")
                failing = False
            except REDIS_ERRORS as exc:
                if not failing:
                    log.warning("heartbeat failed: %s; retrying every beat", refusal(exc) or exc)
                failing = True
            except Exception:  # a thread that dies quietly would make the worker look dead
                log.exception("heartbeat failed")
            self.stopping.wait(self.s.heartbeat_s)

    def beat(self) -> None:
        now = time.time()
        key = names.worker_key(self.s.worker_id)
        ttl = max(1, int(self.s.heartbeat_ttl_s))
        pipe = self.client.pipeline(transaction=False)
        pipe.set(key, orjson.dumps(self.entry()), ex=ttl)
        # a full Redis refuses the SET but not EXPIRE: the entry stays, nobody takes our requests over
        pipe.expire(key, ttl)
        pipe.zadd(names.WORKERS_ZSET, {self.s.worker_id: now + self.s.heartbeat_ttl_s})
        pipe.zremrangebyscore(names.WORKERS_ZSET, "-inf", now)
        pipe.hsetnx(*self._registration())  # written again if a Redis restart lost it
        pipe.sadd(names.SERVED_NAMES, self.s.served_name)
        pipe.execute()

    def deregister(self) -> None:
        """Gone at once rather than when the TTL runs out, so live workers take over sooner."""
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(names.worker_key(self.s.worker_id))
            pipe.zrem(names.WORKERS_ZSET, self.s.worker_id)
            pipe.execute()
        except REDIS_ERRORS:
            pass
