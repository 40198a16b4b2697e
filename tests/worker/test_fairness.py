"""The fair order on constructed queues (worker/fairness.py through the consumer's choice): the
least-served tenant goes first within a priority and lane, no backlogged tenant falls more than one
request behind another, weights give proportional shares, priorities and the interactive lane still
win, and a tenant back from idle is lifted to the others' level. The queues are fed to a real
StreamConsumer as XREADGROUP replies; nothing here talks to Redis (choosing never does)."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.settings import WorkerSettings
from worker.consumer import StreamConsumer
from worker.fairness import FairOrder, claim_of

_ids = itertools.count()


def _consumer(lookahead: int = 64) -> StreamConsumer:
    return StreamConsumer(None, WorkerSettings(model="m", served_name="demo", fair_lookahead=lookahead),
                          FairOrder())


def _feed(c: StreamConsumer, entries: list[tuple[str | None, int, float]], lane: str | None = None) -> None:
    """(tenant, priority, weight) entries, as a read of `lane` (default interactive) returns them."""
    stream = lane or c.stream
    reply = [[stream.encode(), [(f"{next(_ids)}-0".encode(),
                                 {b"m": orjson.dumps({"request_id": f"r{next(_ids)}", "key_id": t,
                                                      "priority": p, "weight": w})})
                                for t, p, w in entries]]]
    c.received([(stream, len(entries) + 1)], [reply])


def _serve(c: StreamConsumer, cost: dict[str, int]):
    """Admit the next entry and charge its tenant `cost[tenant]` tokens at once (prompt + output)."""
    p = c.next()
    c.order.started(p.claim.request_id, p.claim, cost[p.claim.tenant])
    c.order.served([], alive=lambda rid: False)  # finished: it no longer holds its tenant active
    return p


tenants = st.lists(st.sampled_from("abcde"), min_size=2, max_size=60)
costs = st.fixed_dictionaries({t: st.integers(1, 500) for t in "abcde"})


@settings(max_examples=60, deadline=None)
@given(tenants, costs)
def test_the_least_served_tenant_goes_first_and_none_falls_more_than_one_request_behind(queue, cost):
    c = _consumer()
    _feed(c, [(t, 0, 1.0) for t in queue])
    left = {t: queue.count(t) for t in set(queue)}
    biggest = max(cost.values())
    while c.backlog:
        waiting = {p.claim.tenant for p in c.backlog}
        p = _serve(c, cost)
        chosen = p.claim.tenant
        counters = c.order.counters
        # it was the least served of those waiting (its counter before this charge)
        assert all(counters[chosen] - cost[chosen] <= counters[t] for t in waiting)
        left[chosen] -= 1
        backlogged = [t for t in left if left[t]]
        # one round: no tenant with work is more than one request's cost behind another
        if backlogged:
            spread = max(counters[t] for t in backlogged) - min(counters[t] for t in backlogged)
            assert spread <= biggest


@settings(max_examples=30, deadline=None)
@given(st.floats(0.25, 8), st.integers(5, 200))
def test_weights_give_proportional_shares_while_both_wait(weight, tokens):
    c = _consumer()
    _feed(c, [("heavy", 0, weight)] * 400 + [("light", 0, 1.0)] * 400)
    served = {"heavy": 0, "light": 0}
    for _ in range(400):
        served[_serve(c, {"heavy": tokens, "light": tokens}).claim.tenant] += tokens
    share = served["heavy"] / sum(served.values())
    assert abs(share - weight / (1 + weight)) <= 0.02 + 2 * tokens / sum(served.values())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(-2, 2)), min_size=1, max_size=40))
def test_priorities_and_the_interactive_lane_still_win(entries):
    c = _consumer()
    _feed(c, [(t, p, 1.0) for t, p in entries], lane=c.batch_stream)
    _feed(c, [(t, p + 3, 1.0) for t, p in entries])  # interactive, each worse than any batch priority
    cost = dict.fromkeys("abc", 10)
    order = [_serve(c, cost) for _ in range(2 * len(entries))]
    lanes = [p.stream for p in order]
    assert lanes == [c.stream] * len(entries) + [c.batch_stream] * len(entries)
    for lane in (order[:len(entries)], order[len(entries):]):
        assert [p.claim.priority for p in lane] == sorted(p.claim.priority for p in lane)


def test_a_tenant_back_from_idle_is_lifted_and_banks_no_credit():
    c = _consumer()
    _feed(c, [("a", 0, 1.0)] * 50)
    cost = {"a": 100, "b": 100}
    for _ in range(20):
        _serve(c, cost)
    level = c.order.counters["a"]
    _feed(c, [("b", 0, 1.0)] * 10)  # b was never served: it starts at a's level, not at 0
    assert c.order.counters["b"] == level
    picks = "".join(_serve(c, cost).claim.tenant for _ in range(20))
    assert picks.count("b") == 10 and "bb" not in picks  # served in turn with a, never in a run


def test_the_lift_with_nobody_active_uses_the_level_last_seen():
    order = FairOrder()
    order.lift("a", set())
    order.charge("a", 1000, 1.0)
    order.lift("b", {"a"})  # b starts at a's 1000
    assert order.counter("b") == 1000
    order.lift("c", set())  # everyone idle now: c still starts at the level last seen
    assert order.counter("c") == 1000


def test_the_engine_queue_order_follows_the_counters():
    order = FairOrder()
    order.started("r-a", claim_of(orjson.dumps({"request_id": "r-a", "key_id": "a"})), 500)
    order.started("r-b", claim_of(orjson.dumps({"request_id": "r-b", "key_id": "b"})), 10)
    assert order.request_counter("r-b") < order.request_counter("r-a")
    order.served([SimpleNamespace(request_id="r-b", new_token_ids=[1] * 1000)], alive=lambda rid: True)
    assert order.request_counter("r-a") < order.request_counter("r-b")


def test_entries_that_do_not_decode_share_one_tenant_at_default_weight():
    assert claim_of(b"not json").tenant == claim_of(orjson.dumps({"key_id": None})).tenant
    assert claim_of(orjson.dumps({"key_id": "k", "weight": 1e9, "priority": "x"})).weight == 100.0
    assert claim_of(orjson.dumps({"weight": True})).weight == 1.0


def test_reads_fill_the_look_ahead_per_lane_and_fifo_reads_only_the_room():
    fair = _consumer(lookahead=8)
    assert fair.next_reads(0) == []  # nothing can start: nothing is read
    assert fair.next_reads(2) == [(fair.stream, 8), (fair.batch_stream, 8)]
    _feed(fair, [("a", 0, 1.0)] * 5)  # a short read: the interactive lane is drained
    assert fair.next_reads(1) == [(fair.stream, 3), (fair.batch_stream, 8)]
    fair.received([(fair.stream, 3)], [[[fair.stream.encode(), [(b"9-0", {b"m": b"{}"})] * 3]]])
    assert fair.next_reads(1) == []  # the look-ahead is full and the lane was not drained
    fifo = StreamConsumer(None, WorkerSettings(model="m", served_name="demo"))
    assert fifo.next_reads(2) == [(fifo.stream, 2), (fifo.batch_stream, 2)]


def _holding(order: FairOrder, tenant: str, n: int, weight: float = 1.0, served: int = 0) -> None:
    """`n` running requests of `tenant`, which has been served `served` tokens in all."""
    for i in range(n):
        order.started(f"{tenant}-{i}", claim_of(orjson.dumps({"request_id": f"{tenant}-{i}", "key_id": tenant,
                                                               "weight": weight})), served if i == 0 else 0)


def _claim(tenant: str, weight: float = 1.0):
    return claim_of(orjson.dumps({"request_id": f"new-{tenant}", "key_id": tenant, "weight": weight}))


def test_a_tenant_above_its_share_and_served_more_yields_a_slot_to_one_below():
    order = FairOrder()
    _holding(order, "a", 4, served=400)
    order.lift("b", {"a"})  # B arrives level with A: owed nothing yet
    assert order.over_share(_claim("b"), {"a": 4}, slots=4) is None
    order.charge("a", 64, 1.0)  # a step of A's batch later, B is owed
    assert order.over_share(_claim("b"), {"a": 4}, slots=4) == "a"
    # within its share (2 of 4 at equal weights) B asks for no more; with weight 2, one more
    assert order.over_share(_claim("b"), {"a": 2, "b": 2}, slots=4) is None
    assert order.over_share(_claim("b", weight=2.0), {"a": 3, "b": 1}, slots=4) == "a"
    assert order.over_share(_claim("b", weight=2.0), {"a": 2, "b": 2}, slots=4) is None
    # a single slot is nobody's share: no preemption, the order alone decides the next start
    assert order.over_share(_claim("b"), {"a": 1}, slots=1) is None


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from("abcd"), st.tuples(st.integers(1, 8), st.sampled_from([0.5, 1.0, 2.0]),
                                                        st.integers(0, 1000)), min_size=1),
       st.sampled_from("abcde"), st.sampled_from([0.5, 1.0, 2.0]), st.integers(0, 1000))
def test_only_a_tenant_over_its_share_and_ahead_yields_and_only_to_one_under(held, tenant, weight, served):
    order = FairOrder()
    for t, (n, w, s) in held.items():
        _holding(order, t, n, weight=w, served=s)
    if tenant not in held:
        order.charge(tenant, served, weight)
    claim = _claim(tenant, weight if tenant not in held else held[tenant][1])
    holders = {t: n for t, (n, _, _) in held.items()}
    slots = sum(holders.values())
    victim = order.over_share(claim, holders, slots)
    weights = {t: w for t, (_, w, _) in held.items()} | {tenant: claim.weight}
    total = sum(weights.values())
    if victim is not None:
        assert victim != tenant
        assert holders[victim] > slots * weights[victim] / total  # above its share
        assert order.counter(victim) > order.counter(tenant)  # and served more
        assert holders.get(tenant, 0) + 1 <= slots * claim.weight / total + 1e-9  # still within its own
    elif holders.get(tenant, 0) + 1 <= slots * claim.weight / total - 1e-9:
        assert all(holders[t] <= slots * weights[t] / total + 1e-9 or order.counter(t) <= order.counter(tenant)
                   for t in holders if t != tenant)  # nobody could have yielded


def test_with_yielding_the_fair_order_reads_ahead_while_the_batch_is_full():
    fair = _consumer(lookahead=8)
    assert fair.next_reads(0, yielding=True) == [(fair.stream, 8), (fair.batch_stream, 8)]
    fifo = StreamConsumer(None, WorkerSettings(model="m", served_name="demo"))
    assert fifo.next_reads(0, yielding=True) == []  # FIFO never reads what cannot start
    _feed(fair, [("a", 0, 1.0), ("b", 0, 1.0)])
    assert fair.peek() is fair.backlog[0] and len(fair.backlog) == 2  # peek takes nothing
    assert fair.next() is not None and len(fair.backlog) == 1
