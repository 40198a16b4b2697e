"""/admin/canary: put a version on trial under an alias, watch it, promote, roll back, pause."""
from __future__ import annotations

from collections import Counter
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import APIRouter, Depends, Path

from gateway.admin_api import ERRORS
from gateway.auth import require_admin
from gateway.canary_schemas import (CanaryRollback, CanarySet, CanaryStatus, RouteList,
                                    VersionObserved)
from gateway.deps import RouterDep
from gateway.routing import Router
from gateway.strict_json import ParsedJSONRoute
from shared import canary, canary_stats, names
from shared.canary import Route, RouteStore
from shared.errors import Conflict, InvalidRequest, NotFound

Alias = Annotated[str, Path(max_length=256, description="The served name clients ask for")]
router = APIRouter(prefix="/admin/canary", dependencies=[Depends(require_admin)], tags=["admin"],
                   responses=ERRORS, route_class=ParsedJSONRoute)


async def _store(routing: RouterDep) -> RouteStore:
    return routing.store


Routes = Annotated[RouteStore, Depends(_store)]


async def _known_versions(redis: aioredis.Redis, alias: str) -> set[str]:
    raw = await redis.hkeys(names.model_versions_key(alias))
    return {v.decode() for v in raw}


async def _stable_for(routing: Router, alias: str, body: CanarySet, current: Route | None) -> str:
    if body.stable:
        return body.stable
    if current is not None:
        return current.stable
    live = await routing.live_versions(alias) - {body.version}
    known = await _known_versions(routing.redis, alias) - {body.version}
    for candidates in (live, known):
        if len(candidates) == 1:
            return next(iter(candidates))
    raise InvalidRequest(f"Cannot tell which version of '{alias}' is stable ({sorted(known)}); "
                         "name it with 'stable'", param="stable")


@router.put("/{alias}", response_model=Route)
async def set_canary(alias: Alias, body: CanarySet, routing: RouterDep) -> Route:
    """Put `version` on trial; replaces any canary the alias had (its stable stays). The canary
    may have no worker yet: its share is served by stable (failover) until one is live, so a
    route can be set before the new version's workers start."""
    store = routing.store
    current = await store.get(alias)
    stable = await _stable_for(routing, alias, body, current)
    known = await _known_versions(routing.redis, alias)
    pinned = ((f"cohorts.{c}", v) for c, v in body.cohorts.items())
    for param, version in (("stable", stable), *pinned):
        if version not in known:
            raise NotFound(f"No worker ever served '{alias}' version '{version}'", param=param,
                           code="version_not_found")
    if stable == body.version:
        raise InvalidRequest("The canary must differ from the stable version", param="version")
    weight = body.weight if body.weight is not None else (body.steps[0] if body.steps else 0.0)
    route = canary.new_route(alias, stable, body.version, weight=weight, steps=body.steps,
                             interval_s=body.interval_s, cohorts=body.cohorts,
                             thresholds=body.thresholds)
    route, _ = await store.change(alias, lambda _: route)
    steps = f", steps {route.steps} every {route.interval_s}s" if route.steps else ""
    await store.add_event(route, "set", f"{route.canary} on trial at {route.weight:g}%{steps}; "
                                        f"stable {route.stable}")
    return route


@router.get("", response_model=RouteList)
async def list_routes(store: Routes) -> RouteList:
    routes = [await store.get(alias) for alias in await store.aliases()]
    return RouteList(data=[r for r in routes if r is not None])


@router.get("/{alias}", response_model=CanaryStatus)
async def canary_status(alias: Alias, routing: RouterDep) -> CanaryStatus:
    """The route, the configured and observed split, success rate and latency per version over
    the analysis window, counters, and the last events."""
    store = routing.store
    route = await _get(store, alias)
    t = route.thresholds
    stats = await canary_stats.read(routing.redis, alias, route.versions(), t.window_s,
                                    since=route.started)
    total = sum(s.requests for s in stats.values())
    workers = Counter(w["version"] for w in await routing.live_workers(alias))
    breakers = await routing.breaker.states([(alias, v) for v in stats])
    versions = {}
    for version, s in stats.items():
        role = "canary" if version == route.canary else "stable"
        share = route.weight if role == "canary" else 100 - (route.weight if route.on_trial else 0)
        versions[version] = VersionObserved(
            **s.summary().model_dump(), role=role, configured_share=share,
            observed_share=round(100 * s.requests / total, 2) if total else None,
            live_workers=workers[version], breaker=breakers[(alias, version)])
    return CanaryStatus(route=route, versions=versions, counters=await store.counters(alias),
                        events=await store.events(alias))


@router.post("/{alias}/promote", response_model=Route)
async def promote(alias: Alias, routing: RouterDep) -> Route:
    """The canary becomes stable for everyone, now: only a version some worker has served, as a
    stable must be when it is set (else every request for the alias would find no worker)."""
    store = routing.store
    route = await _get(store, alias)
    if route.on_trial and route.canary not in await _known_versions(routing.redis, alias):
        raise Conflict(f"No worker ever served '{alias}' version '{route.canary}': it cannot become "
                       "stable; start its workers first, or roll it back", param="alias",
                       code="version_not_served")
    route = await _transition(store, alias, canary.promoted)
    await store.count(alias, "promotions")
    await store.add_event(route, "promote", f"{route.stable} promoted to stable by an admin")
    return route


@router.post("/{alias}/rollback", response_model=Route)
async def rollback(alias: Alias, store: Routes, body: CanaryRollback | None = None) -> Route:
    """Everyone back on stable (canary weight 0); the canary stays named for the record."""
    reason = (body or CanaryRollback()).reason
    route = await _transition(store, alias, lambda r: canary.rolled_back(r, reason))
    await store.count(alias, "manual_rollbacks")
    await store.add_event(route, "rollback", f"{route.canary} rolled back: {reason}")
    return route


@router.post("/{alias}/pause", response_model=Route)
async def pause(alias: Alias, store: Routes) -> Route:
    """Steps stop advancing; an automatic rollback still happens if the analysis fails."""
    return await _pause(store, alias, True)


@router.post("/{alias}/resume", response_model=Route)
async def resume(alias: Alias, store: Routes) -> Route:
    return await _pause(store, alias, False)


async def _pause(store: RouteStore, alias: str, pause: bool) -> Route:
    if (route := await _get(store, alias)).on_trial and route.paused == pause:
        return route  # already so: no write, no event
    route = await _transition(store, alias, lambda r: canary.paused(r, pause))
    await store.add_event(route, "pause" if pause else "resume",
                          f"steps {'paused' if pause else 'resumed'} at {route.weight:g}%")
    return route


async def _get(store: RouteStore, alias: str) -> Route:
    route = await store.get(alias)
    if route is None:
        raise NotFound(f"'{alias}' has no canary route", param="alias", code="route_not_found")
    return route


async def _transition(store: RouteStore, alias: str, edit) -> Route:
    """Apply a transition to a route whose canary is on trial (409 otherwise)."""
    await _get(store, alias)
    route, changed = await store.change(alias, lambda r: edit(r) if r and r.on_trial else None)
    if not changed:
        raise Conflict(f"'{alias}' has no canary on trial (phase {route.phase})", param="alias",
                       code="no_canary_on_trial")
    return route
