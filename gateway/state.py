"""What one gateway process holds for its requests: one typed object, built at start-up and reached
by handlers through the aliases in gateway/deps.py (never through `app.state` by name)."""
from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError

from gateway.batch_queue import BatchQueue
from gateway.breaker import Breaker
from gateway.checker import Checker
from gateway.dispatch import Dispatcher
from gateway.keystore import KeyStore
from gateway.limits import Limits
from gateway.loop_lag import LoopLag
from gateway.pool_trim import PoolTrim
from gateway.registry import Registry
from gateway.reply_queue import Unread
from gateway.rescue import Rescuer
from gateway.retry import Retarget
from gateway.routing import Router
from gateway.stream_leases import StreamLeases
from gateway.throttle import Throttle
from shared import names
from shared.batches import BatchStore
from shared.files import FileStore
from shared.redis_client import async_client, broker_options, broker_url
from shared.settings import GatewaySettings
from shared.usage import UsageBook


@dataclass
class GatewayState:
    settings: GatewaySettings
    throttle: Throttle  # per-address, in this process's memory: made before the app (routes use it)
    redis: aioredis.Redis
    registry: Registry
    router: Router
    rescuer: Rescuer
    keystore: KeyStore
    limits: Limits
    usage: UsageBook
    files: FileStore
    batches: BatchStore
    batch_queue: BatchQueue
    dispatcher: Dispatcher
    streams: StreamLeases  # streams that outlive their client or their gateway, settled once
    loop_lag: LoopLag
    pool_trim: PoolTrim  # a burst's Redis connections close once idle
    checker: Checker  # schemas, regexes and grammars, checked in a process of their own

    @classmethod
    def connect(cls, settings: GatewaySettings, throttle: Throttle) -> GatewayState:
        """Everything on one Redis client; nothing runs until `start`."""
        client = _redis(settings)
        registry = Registry(client)
        breaker = Breaker(client, settings.breaker_failures, settings.breaker_window_s,
                          settings.breaker_open_s)
        router = Router(client, registry, settings.worker_stale_s, breaker)
        limits, usage = Limits(client, settings), UsageBook(client, settings.usage_retention_days)
        dispatcher = Dispatcher(client, settings.gateway_id, settings.max_stream_depth,
                                settings.interactive_mark_ms, settings.max_entry_bytes,
                                settings.retries_before_first_token, Retarget(router, registry),
                                breaker, settings.fair_queue_per_key,
                                Unread(settings.max_unread_replies, settings.max_unread_replies_total))
        keystore = KeyStore(client, settings.secret.get_secret_value(), settings.key_cache_s,
                            live=dispatcher.subscribed.is_set)
        dispatcher.listen_also(names.KEYS_CHANGED_CHANNEL, keystore.on_changed, keystore.forget)
        return cls(
            settings=settings, throttle=throttle, redis=client, registry=registry, router=router,
            rescuer=Rescuer(client, router, settings.max_stream_depth),
            keystore=keystore,
            limits=limits, usage=usage,
            files=FileStore(client, settings.data_dir, settings.file_retention_s),
            batches=BatchStore(client, settings.file_retention_s),
            batch_queue=BatchQueue(broker_url(settings), broker_options(settings)),
            dispatcher=dispatcher,
            streams=StreamLeases(client, settings.gateway_id, settings.resume_grace_s, limits, usage,
                                 dispatcher.cancel_soon),
            loop_lag=LoopLag(),
            pool_trim=PoolTrim(getattr(client, "connection_pool", None), settings.redis_idle_timeout_s),
            checker=Checker(settings.grammar_check_timeout_s, settings.grammar_check_processes,
                            settings.grammar_check_memory_mb))

    async def start(self) -> None:
        await self.dispatcher.start()  # subscribed before any request can be dispatched
        await self.rescuer.start()
        await self.streams.start()
        self.loop_lag.start()
        self.pool_trim.start()

    async def stop(self) -> None:
        self.loop_lag.stop()
        self.pool_trim.stop()
        await self.streams.stop()
        await self.rescuer.stop()
        await self.dispatcher.stop()
        await self.checker.stop()
        await self.redis.aclose()


def _redis(settings: GatewaySettings) -> aioredis.Redis:
    # a blocking pool (one Redis): a burst of requests waits for a connection instead of a 503;
    # a connection left stale by a Redis restart is retried on a fresh one, not surfaced
    return async_client(settings, max_connections=settings.redis_max_connections,
                        socket_connect_timeout=2, socket_timeout=5, health_check_interval=10,
                        retry=Retry(ExponentialBackoff(cap=0.2), 2),
                        retry_on_error=[ConnectionError, TimeoutError])
