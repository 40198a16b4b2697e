"""Which version of a served name serves a request: the `x-kvgate-version` header (admin keys and
keys marked for it), else the alias's canary route (the key's cohort, else its sticky bucket), else
the newest live version; then failover to a route version that has a live worker; then the
version's circuit breaker (gateway/breaker.py): an open one sends a canary's requests to stable,
anyone else's get a fast 503.

Routes are cached for half a second per process, so a change reaches every gateway within a second.
A worker counts as live here while its last heartbeat is younger than `worker_stale_s`, so a
killed canary stops getting traffic seconds after it died, not when its registry entry expires.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from gateway.breaker import Breaker
from gateway.keys import KeyRecord
from gateway.registry import Registry
from shared import canary_stats, names, protocol
from shared.canary import Route, RouteStore, assign
from shared.errors import KvgateError, NotFound, Overloaded, PermissionDenied

VERSION_HEADER = "x-kvgate-version"
ROUTE_CACHE_S = 0.5
ROUTE_CACHE_SIZE = 1024  # names without a route cached per process: a flood of made-up names
# evicts the oldest, never grows memory


VERSION_HEADER_DOC = {"parameters": [{
    "name": VERSION_HEADER, "in": "header", "required": False, "schema": {"type": "string"},
    "description": "Serve from this version of the model (admin keys and keys with version_override "
                   "only); every response names the version that served it"}]}
"""The header in a generation route's OpenAPI operation (`openapi_extra`); the route reads it from
the request. Declared as a dependency instead, FastAPI would solve it on every call."""


@dataclass
class Outcome:
    """One request as the gateway saw it, for the canary analysis: when its tokens came, how it
    ended. `ok` stays None when it ended by no fault of the version (client left, bad input)."""

    alias: str
    version: str
    window_s: int | None  # the route's window; None: the alias has no route, nothing is recorded
    start: float = field(default_factory=time.monotonic)
    first: float | None = None
    last: float | None = None
    tokens: dict[int, int] = field(default_factory=dict)
    ok: bool | None = None
    probe: str | None = None  # the breaker's probe token when this request half-opens its version

    def saw(self, reply) -> None:
        if isinstance(reply, protocol.Delta) and (reply.token_ids or reply.text):  # not the verdict
            self.last = time.monotonic()
            self.first = self.first or self.last
            self.tokens[reply.index] = self.tokens.get(reply.index, 0) + len(reply.token_ids)
        elif isinstance(reply, protocol.Done) and self.ok is None:
            self.ok = True

    def failed(self, exc: KvgateError) -> None:
        if exc.status >= 500:
            self.ok = False

    def absorbed(self, version: str, exc: KvgateError) -> None:
        """A failure of this request's version that a retry cured for the client (gateway/retry.py)
        is still the version's failure: the canary analysis must see it, or a failing canary whose
        requests are all rescued by its stable version would never be rolled back."""
        if version == self.version:
            self.failed(exc)

    def ttft_ms(self) -> float | None:
        return None if self.first is None else (self.first - self.start) * 1000

    def tpot_ms(self) -> float | None:
        n = max(self.tokens.values(), default=0)
        return None if n < 2 else (self.last - self.first) * 1000 / (n - 1)


async def observed(replies: AsyncIterator, outcome: Outcome) -> AsyncIterator:
    """The replies, passed on as they come, noted on `outcome` on the way."""
    try:
        async for reply in replies:
            outcome.saw(reply)
            yield reply
    except KvgateError as exc:
        outcome.failed(exc)
        raise


class Router:
    def __init__(self, redis: aioredis.Redis, registry: Registry, stale_s: float,
                 breaker: Breaker | None = None):
        self.redis = redis
        self.registry = registry
        self.stale_s = stale_s
        self.breaker = breaker or Breaker(redis, 0, 1, 1)  # failures 0: never opens
        self.store = RouteStore(redis)
        self._routes: dict[str, tuple[float, Route]] = {}  # aliases with a route (admin-made: few)
        self._routeless: OrderedDict[str, float] = OrderedDict()  # names without: bounded LRU

    async def route_of(self, alias: str) -> Route | None:
        now = time.monotonic()
        if alias in self._routes and now - self._routes[alias][0] < ROUTE_CACHE_S:
            return self._routes[alias][1]
        if now - self._routeless.get(alias, -ROUTE_CACHE_S) < ROUTE_CACHE_S:
            return None
        route = await self.store.get(alias)
        if route is not None:
            self._routes[alias] = (now, route)
            self._routeless.pop(alias, None)
            return route
        self._routes.pop(alias, None)
        self._routeless[alias] = now
        self._routeless.move_to_end(alias)
        while len(self._routeless) > ROUTE_CACHE_SIZE:
            self._routeless.popitem(last=False)
        return None

    def cached_routes(self) -> list[Route]:
        """The routes this process has served lately (what gateway/rescue.py sweeps)."""
        return [route for _, route in list(self._routes.values())]

    async def live_workers(self, alias: str) -> list[dict]:
        fresh = time.time() - self.stale_s
        return [w for w in await self.registry.live_workers()
                if w["served_name"] == alias and w.get("ts", 0) >= fresh]

    async def live_versions(self, alias: str) -> set[str]:
        return {w["version"] for w in await self.live_workers(alias)}

    async def choose(self, alias: str, key: KeyRecord, forced: str | None = None,
                     through_breaker: bool = True) -> Outcome:
        """The version for this request, as the Outcome that will record how it went.
        `through_breaker` False: its breaker is passed at the XADD (gateway/dispatch.py), in the
        same round trip, and `past_breaker` says where a refused request goes."""
        route = await self.route_of(alias)
        if forced is not None:
            version = await self._forced(alias, key, forced)
        elif route is None:
            version = await self.registry.route(alias)
        else:
            version = await self._failover(route, assign(route, key.id, key.canary_cohort))
        probe = None
        if through_breaker:
            version, probe = await self._through_breaker(alias, version, route if forced is None else None)
        return Outcome(alias, version, route.thresholds.window_s if route else None, probe=probe)

    async def past_breaker(self, outcome: Outcome, forced: bool) -> Outcome:
        """After the breaker of `outcome.version` refused it at its XADD: the route's stable
        version for a canary's request (if its breaker lets it through), else the 503."""
        route = None if forced else await self.route_of(outcome.alias)
        version, probe = await self._through_breaker(outcome.alias, outcome.version, route)
        return Outcome(outcome.alias, version, outcome.window_s, probe=probe)

    async def _through_breaker(self, alias: str, version: str, route: Route | None) -> tuple[str, str | None]:
        """The version (and probe token) once its breaker has had its say: an open one's canary
        traffic goes to a live stable version whose breaker lets it through; else a 503 naming it."""
        verdict = await self.breaker.admit(alias, version)
        if verdict.allowed:
            return version, verdict.probe
        if (route is not None and route.on_trial and version == route.canary
                and route.stable in await self.live_versions(alias)):
            if (stable := await self.breaker.admit(alias, route.stable)).allowed:
                await self.store.count(alias, "breaker_failovers")
                return route.stable, stable.probe
        raise self.breaker.refusal(alias, version, verdict)

    async def _forced(self, alias: str, key: KeyRecord, version: str) -> str:
        if key.role != "admin" and not key.version_override:
            raise PermissionDenied(f"This API key may not choose a version ({VERSION_HEADER})",
                                   param=VERSION_HEADER, code="version_override_not_allowed")
        if version in await self.live_versions(alias):
            return version
        if not await self.redis.hexists(names.model_versions_key(alias), version):
            raise NotFound(f"The model '{alias}' has no version '{version}'", param=VERSION_HEADER)
        raise Overloaded(f"No live worker serves '{alias}' version '{version}' right now; retry "
                         "shortly", param=VERSION_HEADER, retry_after=2)

    async def version_for(self, alias: str, key: KeyRecord) -> str:
        """The version `choose` would give this key now, without counting a failover: for
        /v1/models, which only looks."""
        route = await self.route_of(alias)
        if route is None:
            return await self.registry.route(alias)
        wanted = assign(route, key.id, key.canary_cohort)
        return _pick(route, wanted, await self.live_versions(alias)) or wanted

    async def _failover(self, route: Route, wanted: str) -> str:
        version = _pick(route, wanted, await self.live_versions(route.alias))
        if version is None:
            raise Overloaded(f"No live worker serves '{route.alias}' right now; retry shortly",
                             param="model", retry_after=2)
        if version != wanted:
            await self.store.count(route.alias, "failovers")
        return version

    async def record(self, outcome: Outcome) -> None:
        """Adds a finished request to its version's window (only for aliases with a route)."""
        if outcome.window_s is None or outcome.ok is None:
            return
        await canary_stats.record(self.redis, outcome.alias, outcome.version, outcome.window_s,
                                  outcome.ok, outcome.ttft_ms(), outcome.tpot_ms())


def _pick(route: Route, wanted: str, live: set[str]) -> str | None:
    """`wanted` if it has a live worker, else the first of the route's versions that has one."""
    if wanted in live:
        return wanted
    return next((v for v in route.versions() if v in live), None)
