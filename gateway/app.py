"""The gateway's FastAPI app: wiring only. Routes live in their own modules."""
from __future__ import annotations

import gc
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from gateway import errors
from gateway.admin_api import router as admin_router
from gateway.anthropic_shape import AnthropicShape
from gateway.auth import AuthFirst
from gateway.batches_api import router as batches_router
from gateway.files_api import UPLOAD_ENVELOPE_BYTES, router as files_router
from gateway.canary_api import router as canary_router
from gateway.client_writes import WriteDeadline
from gateway.deps import StateDep
from gateway.body_limit import BodyLimitMiddleware
from gateway.embeddings_api import router as embeddings_router
from gateway.scores_api import router as scores_router
from gateway import metrics as prometheus
from gateway.observe import Observe
from gateway.messages_api import router as messages_router
from gateway.openai_api import router as openai_router
from gateway.ratelimit_headers import RateLimitHeaders
from gateway.responses_api import router as responses_router
from gateway.state import GatewayState
from gateway.strict_json import StrictJSONMiddleware
from gateway.tokenize_api import router as tokenize_router
from gateway.throttle import Throttle
from shared import logs, telemetry
from shared.settings import GatewaySettings


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    if settings.secret is None:
        raise SystemExit("kvgate gateway: set KVGATE_SECRET, the server secret keys are HMAC-ed with")

    # per-address throttles (slowapi, in this process's memory): failed auth, and the routes below
    throttle = Throttle(settings.auth_failures_per_minute, settings.public_per_minute)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.gateway = state = GatewayState.connect(settings, throttle)
        await state.start()
        # what start-up built is never scanned again: a request's burst of objects (a 1 MiB body
        # can be 40,000) sets off collections that would otherwise walk all ~100,000 of them
        gc.freeze()
        yield
        await state.stop()

    # FastAPI's own request spans are off: gateway/observe.py opens the server span, outermost
    app = FastAPI(title="kvgate", version="0.1.0", lifespan=lifespan, telemetry={"tracing": False},
                  description="OpenAI-compatible LLM gateway in front of paged-KV workers")
    public = [Depends(throttle.public_route)]
    errors.install(app)
    app.include_router(openai_router)
    app.include_router(responses_router)
    app.include_router(messages_router)
    app.include_router(tokenize_router)
    app.include_router(embeddings_router)
    app.include_router(scores_router)
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
                       larger={"/v1/files": settings.max_file_bytes + UPLOAD_ENVELOPE_BYTES},
                       read_timeout_s=settings.client_read_timeout_s)
    app.add_middleware(AuthFirst)  # no body is read (or waited for) before its key is known
    app.add_middleware(AnthropicShape)  # outside the body limit: its 413 is rewritten too
    app.add_middleware(Observe)  # sees every refusal and every byte sent
    app.add_middleware(WriteDeadline, timeout_s=settings.client_write_timeout_s)  # outermost
    logs.setup(settings.log_level, "gateway")
    telemetry.setup_tracing("kvgate-gateway", settings.otlp_endpoint)
    return app


def create_app_from_env() -> FastAPI:
    """uvicorn factory (`--factory`), so several worker processes each build their own app."""
    return create_app(GatewaySettings())


async def healthz() -> dict:
    """The process is up."""
    return {"status": "ok"}


async def readyz(state: StateDep):
    """Ready when Redis answers and the reply channel is subscribed."""
    try:
        await state.redis.ping()
    except Exception as exc:
        return JSONResponse({"status": "unavailable", "reason": type(exc).__name__}, status_code=503)
    if not state.dispatcher.subscribed.is_set():
        return JSONResponse({"status": "unavailable", "reason": "not subscribed"}, status_code=503)
    return {"status": "ok"}


async def metrics(state: StateDep) -> Response:
    """Prometheus exposition: every process's metrics summed, then the cluster state from Redis."""
    return Response(await prometheus.page(state), media_type=CONTENT_TYPE_LATEST)
