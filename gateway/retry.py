"""Retry before the first token: a request that fails on a worker before any of its tokens was
produced (an engine error, a failed engine step, a takeover that could not resume it) is sent again,
at most KVGATE_RETRIES times, to the same version, or to the stable version when it had been
routed to a canary on trial. Nothing reached the client, so sending again is safe; after the first
token the error goes to the client as before. The retry is a new entry with its own request id
(`<id>-r<n>`: its replies and reply log are its own), under the same admission: one slot, one
token reservation, usage charged once, for the attempt that finished.
"""
from __future__ import annotations

from prometheus_client import Counter

from gateway.registry import Registry
from gateway.routing import Router
from shared.errors import KvgateError

# codes a worker answers with where the request itself is not at fault (the poison cap is not here:
# it answers an entry that already failed everywhere it went)
RETRYABLE = frozenset({"engine_error", "engine_step_failed", "resume_failed"})
RETRIES = Counter("kvgate_gateway_retries", "Requests sent again after failing before their first "
                  "token, by model, the version that failed, and the error code",
                  ["model", "version", "code"])


def retryable(exc: KvgateError) -> bool:
    return exc.code in RETRYABLE


def counted(model: str, version: str, exc: KvgateError) -> None:
    RETRIES.labels(model, version, exc.code or "").inc()


class Retarget:
    """Where a retry goes: the route's stable version for a canary on trial whose stable version
    has a live worker, else the same version; with the schema its workers speak. None: nowhere,
    the target's circuit breaker is not closed (a retry is never its probe)."""

    def __init__(self, router: Router, registry: Registry):
        self.router, self.registry = router, registry

    async def __call__(self, model: str, version: str) -> tuple[str, int | None] | None:
        route = await self.router.route_of(model)
        if (route is not None and route.on_trial and version == route.canary
                and route.stable in await self.router.live_versions(model)):
            version = route.stable
        if not await self.router.breaker.closed(model, version):
            return None
        return version, (await self.registry.facts(model, version)).schema
