"""How many Redis round trips the gateway makes per request, by phase, so that the count cannot
creep back (issue 25, "Thinner path").

The gateway app runs in-process (httpx's ASGI transport, its lifespan run by hand) in front of a
real worker service (the synthetic engine, in a thread) on a real Redis. Each call of an asyncio
connection's `send_packed_command` in this process is one round trip (a pipeline is one call); a
contextvar set around each request counts only that request's trips (the tasks it starts inherit
the context; the sweepers started with the app do not), and the nearest frame of a known step of
the request path names the phase.
"""
from __future__ import annotations

import asyncio
import contextvars
import sys
from collections import Counter

import httpx
import orjson
import pytest
from redis.asyncio.connection import AbstractConnection

from tests.conftest import until_listed, worker_thread

# (module, function) of a step of the request path -> its phase; the innermost step on the stack
# of a send names it (so the settlement inside admission's teardown counts as settle)
PHASES = {
    ("gateway.auth", "authenticate"): "auth",
    ("gateway.admission", "admit"): "limits",
    ("gateway.openai_api", "_admit"): "limits",
    ("gateway.routing", "choose"): "routing",
    ("gateway.dispatch", "submit"): "dispatch",
    ("gateway.dispatch", "enqueue"): "dispatch",
    ("gateway.openai_api", "_write_lease"): "stream",
    ("gateway.admission", "settle"): "settle",
    ("gateway.holdings", "settle"): "settle",
    ("gateway.dispatch", "replies"): "replies",
    ("gateway.dispatch", "_cancel"): "cancel",
}
# What the request path costs now, in steady state (route and registry caches warm, scripts
# loaded). Lower these when the path gets thinner; never raise them without saying why.
# Before issue 25: auth 1, limits 5 (token window, RPM hit, RPM stats, slot, reservation),
# routing 1 (breaker), dispatch 1, settle 3; streamed: stream 2, settle 5.
# Now: the key's limits are one script (gateway/limits.py ADMIT), run once the body is routed;
# the version's breaker is passed in the bounded XADD's script (gateway/dispatch.py).
# The settlement (tokens, usage, slot) is one script (gateway/limits.py SETTLE); a stream's also
# claims its lease and drops it from the open-streams index in the same script (stream_leases.py
# CLAIM_SETTLE: it was a claim, a ZREM and the settlement, three round trips). A stream's lease
# and its open-streams entry are written in one pipeline while the worker computes its first
# token (the round trip no longer follows the first reply: gateway/openai_api.py). The key's
# record is kept by the gateway (KVGATE_KEY_CACHE_S, dropped at once on any change: pub/sub), so a
# key that called within the last seconds costs no lookup.
NON_STREAMED = {"auth": 0, "limits": 1, "dispatch": 1, "settle": 1}
STREAMED = {**NON_STREAMED, "stream": 1, "settle": 1}
BEFORE_XADD = 1  # the key's limits

_trips: contextvars.ContextVar[Counter | None] = contextvars.ContextVar("trips", default=None)


def _phase() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        phase = PHASES.get((frame.f_globals.get("__name__"), frame.f_code.co_name))
        if phase is not None:
            return phase
        frame = frame.f_back
    return "other"


@pytest.fixture
def counting(monkeypatch):
    send = AbstractConnection.send_packed_command

    async def counted(self, command, check_health=True):
        if (trips := _trips.get()) is not None:
            trips[_phase()] += 1
        return await send(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)


@pytest.fixture
def worker(redis_server, tiny_model_dir):
    with worker_thread(redis_server.url, tiny_model_dir, "trips"):
        yield


async def _counted(client: httpx.AsyncClient, body: dict, secret: str) -> tuple[int, Counter]:
    trips = Counter()
    token = _trips.set(trips)
    try:
        resp = await client.post("/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {secret}"})
        await asyncio.sleep(0.2)  # the teardown and the response's background task run after it
    finally:
        _trips.reset(token)
    assert resp.status_code == 200, resp.text
    return resp, trips


def _steady(runs: list[Counter]) -> Counter:
    """The trips of the runs after the first (which loads the scripts), the most in each phase."""
    return Counter({phase: max(r[phase] for r in runs[1:]) for phase in set().union(*runs)})


def test_round_trips_per_request(redis_server, worker, counting, monkeypatch):
    from gateway import routing
    from gateway.app import create_app
    from gateway.keystore import KeyStore
    from shared import names
    from shared.settings import GatewaySettings
    from shared.usage import utc_day

    settings = GatewaySettings(redis_url=redis_server.url, secret="trips-secret", api_key="sk-boot",
                               key_cache_s=60)  # held for the test, like the route caches below
    app = create_app(settings)
    base = {"model": "trips", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}

    async def run() -> tuple[list[Counter], list[Counter]]:
        async with app.router.lifespan_context(app):
            state = app.state.gateway
            keystore: KeyStore = state.keystore
            record, secret = await keystore.create(keystore.new_record(name="trips", max_concurrent=8))
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30) as client:
                await until_listed(client, "sk-boot")
                # then the route and worker caches (half a second each; a refresh costs 1 and 2
                # trips) held for the test, so that what is counted is the request path, not the
                # clock (held before the worker's first heartbeat, they would keep "no worker")
                monkeypatch.setattr(routing, "ROUTE_CACHE_S", 3600)
                state.registry.cache_s = 3600
                plain, streamed, charged = [], [], 0
                for _ in range(4):
                    resp, trips = await _counted(client, base, secret)
                    charged += resp.json()["usage"]["total_tokens"]
                    plain.append(trips)
                    resp, trips = await _counted(client, {**base, "stream": True, "stream_options":
                                                          {"include_usage": True}}, secret)
                    assert resp.text.rstrip().endswith("data: [DONE]")
                    charged += orjson.loads(resp.text.split("data: ")[-2])["usage"]["total_tokens"]
                    streamed.append(trips)
            # every reservation was replaced by the usage (the first one's script loaded on the
            # way), and every slot given back
            day = await state.redis.get(names.daily_tokens_key(record.id, utc_day()))
            assert int(day) == charged
            assert await state.redis.zcard(names.inflight_key(record.id)) == 0
            return plain, streamed

    plain, streamed = asyncio.run(run())
    measured = (("non-streamed", plain, NON_STREAMED), ("streamed", streamed, STREAMED))
    for label, runs, _ in measured:
        print(f"{label}: {dict(_steady(runs))} (all runs: {[dict(r) for r in runs]})")
    for label, runs, bound in measured:
        steady = _steady(runs)
        for phase, n in steady.items():
            assert n <= bound.get(phase, 0), f"{label}: {phase} took {n} round trips: {dict(steady)}"
        assert steady["auth"] + steady["limits"] + steady["routing"] <= BEFORE_XADD, dict(steady)


# What FastAPI solves per generation call: the endpoint, then each dependency wherever it is named,
# with its own dependencies walked again even when its value is cached (`admit` is named by the
# router and by the endpoint). Before: 11 on /v1/completions (admit's StateDep walked twice more,
# the x-kvgate-version header as a dependency); now the state comes from the request
# (gateway/deps.py `state_of`) and the header is documented in the operation only.
SOLVES = {"/v1/chat/completions": 6, "/v1/completions": 6, "/v1/responses": 8, "/v1/messages": 7}


def test_dependencies_solved_per_generation_call():
    from gateway import messages_api, openai_api, responses_api

    def solves(dependant) -> int:
        return 1 + sum(solves(sub) for sub in dependant.dependencies)

    found = {route.path: solves(route.dependant)
             for module in (openai_api, responses_api, messages_api) for route in module.router.routes
             if route.path in SOLVES and "POST" in route.methods}
    assert found.keys() == SOLVES.keys()
    for path, n in found.items():
        assert n <= SOLVES[path], f"{path} solves {n} dependencies a call: {found}"
