"""The circuit breaker per model version (gateway/breaker.py) on a real Redis: two Breaker objects on
two connections stand in for two gateway replicas; the routing and the dispatcher's Handle feed it
and obey it as a gateway does."""
from __future__ import annotations

import asyncio
import secrets
import time

import pytest
import redis.asyncio as aioredis

from gateway.breaker import CLOSED, HALF_OPEN, OPEN, TRANSITIONS, Breaker
from gateway.dispatch import Dispatcher
from gateway.registry import Registry
from gateway.retry import Retarget
from gateway.routing import Router
from shared import names, protocol
from shared.errors import EngineFailure, KvgateError, Overloaded
from tests.gateway.test_canary_routing import _heartbeat, _key, _put

OPEN_S = 0.4


@pytest.fixture
async def clients(redis_server):
    pair = [aioredis.Redis.from_url(redis_server.url) for _ in range(2)]
    yield pair
    for c in pair:
        await c.aclose()


@pytest.fixture
def model() -> str:
    return "brk-" + secrets.token_hex(4)


def _gateways(clients, failures=3, window_s=5.0) -> list[Breaker]:
    return [Breaker(c, failures, window_s, OPEN_S) for c in clients]


async def _state(b: Breaker, model: str, version: str = "v1") -> str:
    return (await b.states([(model, version)]))[(model, version)]


async def _open(b: Breaker, model: str, n: int = 3) -> None:
    for _ in range(n):
        await b.failed(model, "v1", None)


async def test_opens_after_n_failures_in_the_window_and_every_gateway_sees_it(clients, model):
    a, b = _gateways(clients)
    opened = TRANSITIONS.labels(model, "v1", OPEN)._value.get()
    await _open(a, model, 2)
    assert await _state(b, model) == CLOSED and (await b.admit(model, "v1")).allowed
    await b.failed(model, "v1", None)  # the third, from the other gateway: failures are shared
    assert await _state(a, model) == OPEN
    assert TRANSITIONS.labels(model, "v1", OPEN)._value.get() == opened + 1
    for g in (a, b):
        verdict = await g.admit(model, "v1")
        assert not verdict.allowed and 0 < verdict.wait_s <= OPEN_S
    assert (await a.admit(model, "v2")).allowed  # per version
    refusal = a.refusal(model, "v1", await a.admit(model, "v1"))
    assert refusal.status == 503 and refusal.code == "circuit_open" and refusal.retry_after == 1
    assert f"'{model}' version 'v1'" in refusal.message and "KVGATE_BREAKER_FAILURES" in refusal.message
    state_ttl = await clients[0].pttl(names.breaker_state(model, "v1"))
    assert 0 < state_ttl <= 86_400_000  # TTL'd; the failure window went with the opening
    assert not await clients[0].exists(names.breaker_failures(model, "v1"))


async def test_failures_older_than_the_window_do_not_count(clients, model):
    a, _ = _gateways(clients, window_s=0.3)
    await _open(a, model, 2)
    assert 0 < await clients[0].pttl(names.breaker_failures(model, "v1")) <= 300
    await asyncio.sleep(0.4)
    await a.failed(model, "v1", None)
    assert await _state(a, model) == CLOSED


async def test_one_probe_after_open_s_its_failure_reopens_its_token_closes(clients, model):
    a, b = _gateways(clients)
    await _open(a, model)
    await asyncio.sleep(OPEN_S + 0.05)
    verdicts = await asyncio.gather(*(g.admit(model, "v1") for g in (a, b, a, b)))
    probes = [v.probe for v in verdicts if v.allowed]
    assert len(probes) == 1 and probes[0]  # only one gateway wins the probe
    assert await _state(a, model) == HALF_OPEN
    await b.failed(model, "v1", None)  # a request from before the opening: not the probe
    await b.succeeded(model, "v1", "not-the-probe")
    assert await _state(a, model) == HALF_OPEN
    await a.failed(model, "v1", probes[0])  # the probe failed: open for another OPEN_S
    assert await _state(b, model) == OPEN and not (await b.admit(model, "v1")).allowed
    await asyncio.sleep(OPEN_S + 0.05)
    probe = (await b.admit(model, "v1")).probe
    await b.succeeded(model, "v1", probe)
    assert await _state(a, model) == CLOSED and (await a.admit(model, "v1")).allowed
    assert not await clients[0].exists(names.breaker_state(model, "v1"), names.breaker_failures(model, "v1"))


async def test_a_probe_that_never_answers_lets_another_probe_after_open_s(clients, model):
    a, b = _gateways(clients)
    await _open(a, model)
    await asyncio.sleep(OPEN_S + 0.05)
    assert (await a.admit(model, "v1")).probe  # its gateway dies with it
    assert not (await b.admit(model, "v1")).allowed
    await asyncio.sleep(OPEN_S + 0.05)
    assert (await b.admit(model, "v1")).probe


async def test_zero_failures_means_no_breaker(clients, model):
    off = Breaker(clients[0], 0, 5, OPEN_S)
    for _ in range(5):
        await off.failed(model, "v1", None)
    assert (await off.admit(model, "v1")).allowed
    assert not await clients[0].exists(names.breaker_failures(model, "v1"))


async def test_routing_sends_an_open_canary_to_stable_and_refuses_an_open_stable(clients, model):
    breaker = _gateways(clients)[0]
    router = Router(clients[0], Registry(clients[0]), stale_s=3.0, breaker=breaker)
    for version in ("v1", "v2"):
        await _heartbeat(clients[0], model, version)
    await _put(router, model, stable="v1", canary="v2", weight=100)
    key = _key()
    assert (await router.choose(model, key)).version == "v2"
    for _ in range(3):
        await breaker.failed(model, "v2", None)
    assert (await router.choose(model, key)).version == "v1"
    assert (await router.store.counters(model))["breaker_failovers"] == 1
    with pytest.raises(Overloaded) as forced:  # a version asked for by name is not swapped
        await router.choose(model, _key(role="admin"), forced="v2")
    assert forced.value.code == "circuit_open"
    for _ in range(3):
        await breaker.failed(model, "v1", None)
    with pytest.raises(Overloaded) as both:
        await router.choose(model, key)
    assert both.value.code == "circuit_open" and both.value.retry_after >= 1


def _entry(model: str, request_id: str) -> protocol.RequestEntry:
    return protocol.RequestEntry(request_id=request_id, reply_channel=names.reply_channel("brk-test"),
                                 model=model, version="v1", kind="completion", prompt="hi",
                                 created=time.time(), deadline=time.time() + 30)


async def _answer(d: Dispatcher, handle, *replies) -> None:
    raws = [protocol.encode(r.model_copy(update={"request_id": handle.request_id})) for r in replies]
    await d.redis.publish(d.channel, protocol.encode_replies(raws))


async def _replies_of(d: Dispatcher, handle, *steps) -> list | KvgateError:
    task = asyncio.create_task(_collect(handle))
    for step in steps:
        await asyncio.sleep(0.1)
        await _answer(d, handle, *step)
    try:
        return await asyncio.wait_for(task, 5)
    except KvgateError as exc:
        return exc


async def _collect(handle) -> list:
    return [r async for r in handle.replies(keepalive_s=5)]


def _error(seq: int) -> protocol.ErrorReply:
    return protocol.ErrorReply(request_id="", seq=seq, code="engine_error", message="injected")


async def test_a_failure_a_retry_absorbs_still_counts_and_an_open_breaker_stops_the_retry(clients, model):
    breaker = Breaker(clients[0], 2, 5, OPEN_S)
    router = Router(clients[0], Registry(clients[0]), stale_s=3.0, breaker=breaker)
    await _heartbeat(clients[0], model, "v1")
    d = Dispatcher(clients[0], "brk-test", max_retries=1, retarget=Retarget(router, router.registry),
                   breaker=breaker)
    await d.start()
    try:
        stream = names.request_stream(model, "v1")
        first = await d.submit(stream, _entry(model, "cmpl-1"))
        token = protocol.Delta(request_id="", seq=1, text="x", token_ids=[5])
        done = protocol.Done(request_id="", seq=2, prompt_tokens=1, completion_tokens=1)
        got = await _replies_of(d, first, (_error(1),), (token, done))
        assert isinstance(got, list) and first.retries == 1  # absorbed, yet counted:
        assert await clients[0].zcard(names.breaker_failures(model, "v1")) == 1
        second = await d.submit(stream, _entry(model, "cmpl-2"))
        got = await _replies_of(d, second, (_error(1),))
        assert isinstance(got, EngineFailure) and second.retries == 0  # it opened: no retry there
        assert await _state(breaker, model) == OPEN
        await asyncio.sleep(OPEN_S + 0.05)
        probe = await d.submit(stream, _entry(model, "cmpl-3"), probe=(await breaker.admit(model, "v1")).probe)
        assert await _state(breaker, model) == HALF_OPEN
        got = await _replies_of(d, probe, (protocol.Delta(request_id="", seq=1), token, done))
        assert isinstance(got, list) and await _state(breaker, model) == CLOSED
    finally:
        await d.stop()


def test_both_keys_carry_the_model_s_tag(model):
    """Both keys of a version share its model's slot, so each step is one script on a cluster."""
    assert names.model_tag(model) in names.breaker_state(model, "v1")
    assert names.model_tag(model) in names.breaker_failures(model, "v1")


async def test_the_xadd_passes_the_breaker_in_its_round_trip(clients, model):
    """`submit(gate=True)`: the bounded XADD decides as ADMIT does: an open breaker refuses and
    queues nothing; after OPEN_S one request is the probe (its token on the handle) and the rest
    are refused while it runs; a full stream grants no probe."""
    from gateway.breaker import Refused

    a, b = _gateways(clients)
    d = Dispatcher(clients[0], "brk-gate", max_stream_depth=2, breaker=a)
    await d.start()
    stream = names.request_stream(model, "v1")
    try:
        assert (await d.submit(stream, _entry(model, "cmpl-g0"), gate=True)).probe is None  # closed
        await _open(b, model)
        with pytest.raises(Refused) as refused:
            await d.submit(stream, _entry(model, "cmpl-g1"), gate=True)
        assert 0 < refused.value.wait_s <= OPEN_S and await clients[0].xlen(stream) == 1
        assert "cmpl-g1" not in d.queues
        await asyncio.sleep(OPEN_S + 0.05)
        probe = await d.submit(stream, _entry(model, "cmpl-g2"), gate=True)
        assert probe.probe and await _state(b, model) == HALF_OPEN
        with pytest.raises(Refused):  # one probe at a time, whichever gateway asks
            await d.submit(stream, _entry(model, "cmpl-g3"), gate=True)
        await b.failed(model, "v1", probe.probe)  # the probe failed: open again
        await asyncio.sleep(OPEN_S + 0.05)
        with pytest.raises(Overloaded):  # the stream is at its depth (2): no probe is granted
            await d.submit(stream, _entry(model, "cmpl-g4"), gate=True)
        assert await _state(b, model) == OPEN
    finally:
        await d.stop()


def test_a_request_that_failed_alone_is_neither_counted_nor_sent_again():
    """One tenant's requests that fail alone in a working engine (its content: a grammar with no
    way on, a template its messages break) must not open the breaker for every tenant, nor be
    doubled by a retry; a failed step, an engine failure and a lost resume still are both."""
    from gateway.breaker import counts_against
    from gateway.retry import retryable
    from shared.errors import from_code

    alone = from_code("request_failed", "the engine failed on this request (ValueError)")
    assert alone.status == 500 and not counts_against(alone) and not retryable(alone)
    for code, again in (("engine_error", False), ("engine_step_failed", True), ("resume_failed", True)):
        failure = from_code(code, "x", retryable=again)
        assert counts_against(failure) and retryable(failure), code
