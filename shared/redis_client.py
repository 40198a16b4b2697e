"""The one place Redis clients are made, for every process and every topology.

`KVGATE_REDIS_MODE` picks the client: `single` (one Redis, `from_url` as always), `cluster` (redis-py's
RedisCluster; the URL names any one node, the rest are discovered) or `sentinel` (the URL names the
sentinels, comma-separated, and `KVGATE_REDIS_SENTINEL_SERVICE` the master they watch). AUTH comes from
the URL in every mode; `rediss://` turns TLS on, certificates always verified (against
`KVGATE_REDIS_CA_FILE`, or the system's store). Callers get the same command API in every mode, so
the code path above this module is one.
"""
from __future__ import annotations

import ssl
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.cluster import RedisCluster
from redis.sentinel import Sentinel

from shared.settings import CommonSettings

MODES = ("single", "cluster", "sentinel")


def _tls(settings: CommonSettings, url: str) -> dict[str, Any]:
    """Certificate checks for a `rediss://` URL (none asked of a plain one: it has no TLS)."""
    if not url.startswith("rediss://"):
        return {}
    options: dict[str, Any] = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
    if settings.redis_ca_file:
        options["ssl_ca_certs"] = str(settings.redis_ca_file)
    return options


def _sentinel_parts(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """`redis[s]://[user:pass@]host:port[,host:port...][/db]` -> sentinel addresses, auth and db."""
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    addresses = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":")
        addresses.append((name.strip("[]"), int(port or 26379)))
    auth = {"username": unquote(user) or None, "password": unquote(password) or None}
    db = int(parts.path.strip("/") or 0)
    return addresses, {**auth, "db": db}


def _sentinel_options(settings: CommonSettings, options: dict[str, Any]) -> tuple:
    addresses, auth = _sentinel_parts(settings.redis_url)
    tls = _tls(settings, settings.redis_url)
    if tls:
        tls["ssl"] = True
    conn = {**options, **auth, **tls}
    # the sentinels themselves: the same credentials and TLS, no database
    sentinel = {k: v for k, v in conn.items() if k in ("username", "password", "socket_timeout",
                                                        "socket_connect_timeout") or k.startswith("ssl")}
    return addresses, sentinel, conn


def _service(settings: CommonSettings) -> str:
    if not settings.redis_sentinel_service:
        raise ValueError("KVGATE_REDIS_MODE=sentinel needs KVGATE_REDIS_SENTINEL_SERVICE "
                         "(the name of the master the sentinels watch)")
    return settings.redis_sentinel_service


def sync_client(settings: CommonSettings, **options: Any) -> redis.Redis:
    """A synchronous client (the worker, the CLI)."""
    url = settings.redis_url
    if settings.redis_mode == "cluster":
        return RedisCluster.from_url(url, **options, **_tls(settings, url))
    if settings.redis_mode == "sentinel":
        addresses, sentinel, conn = _sentinel_options(settings, options)
        return Sentinel(addresses, sentinel_kwargs=sentinel, **conn).master_for(_service(settings))
    return redis.Redis.from_url(url, **options, **_tls(settings, url))


def async_client(settings: CommonSettings, max_connections: int | None = None,
                 **options: Any) -> aioredis.Redis:
    """An asyncio client (the gateway, the services). With `max_connections` on one Redis, a
    blocking pool: a burst waits for a connection instead of failing."""
    url = settings.redis_url
    if settings.redis_mode == "cluster":
        if max_connections:
            options["max_connections"] = max_connections  # per node
        return AsyncRedisCluster.from_url(url, **options, **_tls(settings, url))
    if settings.redis_mode == "sentinel":
        addresses, sentinel, conn = _sentinel_options(settings, options)
        if max_connections:
            conn["max_connections"] = max_connections
        return AsyncSentinel(addresses, sentinel_kwargs=sentinel, **conn).master_for(_service(settings))
    if max_connections is None:
        return aioredis.Redis.from_url(url, **options, **_tls(settings, url))
    retry = {k: options.pop(k) for k in ("retry", "retry_on_error") if k in options}
    pool = IdleClosingPool.from_url(url, max_connections=max_connections, timeout=5,
                                                    **options, **_tls(settings, url))
    return aioredis.Redis(connection_pool=pool, **retry)


class IdleClosingPool(aioredis.BlockingConnectionPool):
    """A blocking pool that can close the connections a burst opened once they sit idle: redis-py's
    pools never shrink, and Redis keeps buffers for every open client, so a gateway's burst would
    otherwise hold its peak of connections (and their memory in Redis) for the process's life. The
    pool hands out its most recently released connection first, so under a steady load the same few
    stay busy and the rest go idle, to be closed by `close_idle`."""

    async def release(self, connection: Any) -> None:
        connection.kvgate_idle_since = time.monotonic()
        await super().release(connection)

    async def close_idle(self, idle_s: float) -> int:
        """Close and drop the connections released more than `idle_s` ago; returns how many. They
        leave the free list before the first await, so no caller can be handed one meanwhile; a
        later burst opens new ones up to `max_connections` as ever."""
        cutoff = time.monotonic() - idle_s
        free = self._available_connections
        stale = [c for c in free if getattr(c, "kvgate_idle_since", cutoff) < cutoff]
        if not stale:
            return 0
        gone = {id(c) for c in stale}
        self._available_connections[:] = [c for c in free if id(c) not in gone]
        for connection in stale:
            await connection.disconnect()
        return len(stale)

    def counts(self) -> tuple[int, int]:
        """(idle, in use) connections of this pool, open or not yet reconnected."""
        return len(self._available_connections), len(self._in_use_connections)


def is_cluster(client: Any) -> bool:
    """Whether `client` talks to a Redis Cluster (whose pipelines refuse PUBLISH)."""
    return isinstance(client, (RedisCluster, AsyncRedisCluster))


async def mget(client: aioredis.Redis, keys: list[str]) -> list:
    """MGET of keys in any slots: one command on one Redis, one per slot (in parallel) on a cluster;
    each value read on its own, which is all the callers (registries of independent records) need."""
    if not keys:
        return []
    return await (client.mget_nonatomic(keys) if is_cluster(client) else client.mget(keys))


async def in_steps(client: aioredis.Redis, *steps: Callable[[Any], Any]) -> None:
    """One change made of `steps`, each a function that queues the commands of one hash slot on a
    pipeline: one MULTI on one Redis (one round trip, all or nothing, as ever); on a cluster one
    transaction per step, in order, so callers order the steps to make a failure between harmless."""
    if not is_cluster(client):
        pipe = client.pipeline(transaction=True)
        for step in steps:
            step(pipe)
        await pipe.execute()
        return
    # redis-py queues each command of a cluster transaction on a loop of its own (in a thread): a
    # client first used there would open its connections on that loop, which is closed right after
    await client.initialize()
    for step in steps:
        pipe = client.pipeline(transaction=True)
        step(pipe)
        await pipe.execute()


def broker_url(settings: CommonSettings) -> str:
    """Celery's broker: KVGATE_BROKER_URL, else the main Redis in single mode. Celery's Redis
    transport cannot use Redis Cluster, so cluster (and sentinel) mode must name one."""
    if settings.broker_url:
        return settings.broker_url
    if settings.redis_mode != "single":
        raise ValueError(f"KVGATE_REDIS_MODE={settings.redis_mode} needs KVGATE_BROKER_URL: "
                         "Celery's broker cannot use Redis Cluster or follow the main Redis's "
                         "sentinels; give it a Redis (redis:// or rediss://) of its own")
    return settings.redis_url


def broker_options(settings: CommonSettings) -> dict[str, Any]:
    """Celery settings for the broker connection: TLS verified like every other connection."""
    if not broker_url(settings).startswith("rediss://"):
        return {}
    tls: dict[str, Any] = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    if settings.redis_ca_file:
        tls["ssl_ca_certs"] = str(settings.redis_ca_file)
    return {"broker_use_ssl": tls}
