"""The gateway's FastAPI app: wiring only. Routes live in their own modules."""
from __future__ import annotations

from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from gateway import errors
from gateway.admin_api import router as admin_router
from gateway.batch_queue import BatchQueue
from gateway.batches_api import router as batches_router
from gateway.files_api import UPLOAD_ENVELOPE_BYTES, router as files_router
from gateway.canary_api import router as canary_router
from gateway.body_limit import BodyLimitMiddleware
from gateway.dispatch import Dispatcher
from gateway.keystore import KeyStore
from gateway.limits import Limits
from gateway.metrics import metrics
from gateway.observe import Observe
from gateway.openai_api import router as openai_router
from gateway.ratelimit_headers import RateLimitHeaders
from gateway.registry import Registry
from gateway.routing import Router
from gateway.strict_json import StrictJSONMiddleware
from gateway.throttle import Throttle
from shared import logs, telemetry
from shared.batches import BatchStore
from shared.files import FileStore
from shared.settings import GatewaySettings
from shared.usage import UsageBook


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    if settings.secret is None:
        raise SystemExit("kvgate gateway: set KVGATE_SECRET, the server secret keys are HMAC-ed with")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # a blocking pool: a burst of requests waits for a connection instead of failing with 503
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.redis_url, max_connections=settings.redis_max_connections, timeout=5,
            socket_connect_timeout=2, socket_timeout=5, health_check_interval=10)
        # a connection left stale by a Redis restart is retried on a fresh one, not surfaced
        client = aioredis.Redis(connection_pool=pool, retry=Retry(ExponentialBackoff(cap=0.2), 2),
                                retry_on_error=[ConnectionError, TimeoutError])
        app.state.redis = client
        app.state.registry = Registry(client)
        app.state.router = Router(client, app.state.registry, settings.worker_stale_s,
                                  settings.max_stream_depth)
        app.state.keystore = KeyStore(client, settings.secret.get_secret_value())
        app.state.limits = Limits(client, settings)
        app.state.usage = UsageBook(client, settings.usage_retention_days)
        app.state.files = FileStore(client, settings.data_dir, settings.file_retention_days * 86400)
        app.state.batches = BatchStore(client, settings.file_retention_days * 86400)
        app.state.batch_queue = BatchQueue(settings.redis_url)
        app.state.dispatcher = Dispatcher(client, settings.gateway_id, settings.max_stream_depth,
                                          settings.interactive_mark_ms, settings.max_entry_bytes)
        await app.state.dispatcher.start()
        await app.state.router.start()
        yield
        await app.state.router.stop()
        await app.state.dispatcher.stop()
        await client.aclose()

    # FastAPI's own request spans are off: gateway/observe.py opens the server span, outermost
    app = FastAPI(title="kvgate", version="0.1.0", lifespan=lifespan, telemetry={"tracing": False},
                  description="OpenAI-compatible LLM gateway in front of paged-KV workers")
    app.state.settings = settings
    # per-address throttles (slowapi, in this process's memory): failed auth, and the routes below
    app.state.throttle = throttle = Throttle(settings.auth_failures_per_minute,
                                             settings.public_per_minute)
    public = [Depends(throttle.public_route)]
    errors.install(app)
    app.include_router(openai_router)
    app.include_router(admin_router)
    app.include_router(canary_router)
    app.include_router(files_router)
    app.include_router(batches_router)
    app.add_api_route("/healthz", healthz, methods=["GET"], tags=["health"], dependencies=public)
    app.add_api_route("/readyz", readyz, methods=["GET"], tags=["health"], dependencies=public)
    app.add_api_route("/metrics", metrics, methods=["GET"], tags=["health"], dependencies=public,
                      summary="Prometheus metrics (no key, like the health routes)")
    app.add_middleware(StrictJSONMiddleware)  # inside the body limit: parses bounded bodies only
    app.add_middleware(RateLimitHeaders)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes,
                       larger={"/v1/files": settings.max_file_bytes + UPLOAD_ENVELOPE_BYTES})
    app.add_middleware(Observe)  # outermost: sees every refusal and every byte sent
    logs.setup(settings.log_level, "gateway")
    telemetry.setup_tracing("kvgate-gateway", settings.otlp_endpoint)
    return app


def create_app_from_env() -> FastAPI:
    """uvicorn factory (`--factory`), so several worker processes each build their own app."""
    return create_app(GatewaySettings())


async def healthz() -> dict:
    """The process is up."""
    return {"status": "ok"}


async def readyz(request: Request):
    """Ready when Redis answers and the reply channel is subscribed."""
    try:
        await request.app.state.redis.ping()
    except Exception as exc:
        return JSONResponse({"status": "unavailable", "reason": type(exc).__name__}, status_code=503)
    if not request.app.state.dispatcher.subscribed.is_set():
        return JSONResponse({"status": "unavailable", "reason": "not subscribed"}, status_code=503)
    return {"status": "ok"}
