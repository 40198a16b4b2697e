"""A worker counts each request's outcome once: the registry entry's `requests_*` fields and its
Prometheus request counters are read from one tally, so they agree, whatever the mix of outcomes.

One real worker process on a real Redis, fed by XADD as a gateway would: a request that runs, one
resumed from a dead worker, one the engine refuses, one past its deadline, one cancelled before
pickup, and one retired by the poison cap."""
from __future__ import annotations

import time

import httpx
import pytest

from shared import names, protocol
from tests.integration.test_faults import Cluster
from tests.worker.test_heard_cancels import cancel_before_pickup
from tests.worker.test_wire_schemas import Channel, entry, orphan, xadd
from worker.outcomes import FAILED, REJECTED, Outcomes

MAX_DELIVERIES = 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    c = Cluster(tmp_path_factory.mktemp("outcomes"), tiny_model_dir)
    c.start_worker("w1", KVGATE_MAX_DELIVERIES=str(MAX_DELIVERIES))
    yield c
    c.close()


def _samples(url: str, name: str) -> dict[str, float]:
    """label set (as written) -> value, for one metric of the worker's /metrics."""
    lines = httpx.get(url, timeout=5).text.splitlines()
    return {line[len(name):].rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in lines if line.startswith(name + "{")}


def _by(samples: dict[str, float], label: str) -> dict[str, float]:
    return {key.split(f'{label}="')[1].split('"')[0]: v for key, v in samples.items()}


def test_the_registry_and_prometheus_count_the_same_outcomes(cluster):
    ch = Channel(cluster, "outcomes")
    orphan(cluster, protocol.encode(entry("resumed", ch.name, prompt_token_ids=[5, 6, 7])), delivered=1)
    orphan(cluster, protocol.encode(entry("poison", ch.name, prompt="hi")), delivered=MAX_DELIVERIES)
    xadd(cluster, protocol.encode(entry("runs", ch.name, prompt="Hello there")))
    xadd(cluster, protocol.encode(entry("too-long", ch.name, prompt_token_ids=[5, 6],
                                        params={"max_tokens": 4096})))
    late = entry("late", ch.name, prompt="hi")
    xadd(cluster, protocol.encode(late.model_copy(update={"deadline": time.time() - 1})))
    cancel_before_pickup(cluster, "cancelled")
    xadd(cluster, protocol.encode(entry("cancelled", ch.name, prompt="hi")))

    assert [ch.raw_replies(rid)[-1]["type"] for rid in ("runs", "resumed")] == ["done", "done"]
    codes = {rid: ch.raw_replies(rid)[-1]["code"] for rid in ("too-long", "late", "poison")}
    assert codes == {"too-long": "context_length_exceeded", "late": "timeout",
                     "poison": "request_failed_repeatedly"}
    expected = {"requests_admitted": 2, "requests_resumed": 1, "requests_finished": 2,
                "requests_rejected": 1, "requests_aborted": 1, "requests_failed": 0,
                "requests_poisoned": 1}
    deadline = time.monotonic() + 20
    while (counts := {k: cluster.info("w1")[k] for k in expected}) != expected:  # the next heartbeat
        assert time.monotonic() < deadline, counts
        time.sleep(0.1)

    url = cluster.info("w1")["metrics_url"]
    success = _by(_samples(url, "kvgate_request_success_total"), "finished_reason")
    failures = _by(_samples(url, "kvgate_request_failures_total"), "code")
    [poisoned] = _samples(url, "kvgate_requests_poisoned_total").values()
    assert sum(n for reason, n in success.items() if reason != "abort") == counts["requests_finished"]
    assert success["abort"] == 0  # the cancel came before the start: acknowledged, never run
    assert {code: n for code, n in failures.items() if n} == {
        "context_length_exceeded": 1, "timeout": 1, "request_failed_repeatedly": 1}
    assert poisoned == counts["requests_poisoned"] == failures["request_failed_repeatedly"]


def test_a_request_that_fails_or_is_cancelled_while_running_counts_once():
    """What the test above does not reach: a failure after admission, a cancel mid-run."""
    outcomes = Outcomes()
    for _ in range(3):
        outcomes.admitted(resumed=False)
    outcomes.errored("engine_step_failed", FAILED)
    outcomes.ended("abort")
    outcomes.ended("stop")
    outcomes.errored("invalid_request", REJECTED)
    assert outcomes.registry_fields() == {
        "requests_admitted": 3, "requests_resumed": 0, "requests_finished": 1, "requests_aborted": 1,
        "requests_failed": 1, "requests_rejected": 1, "requests_poisoned": 0}
    assert outcomes.by_code()["engine_step_failed"] == outcomes.by_code()["invalid_request"] == 1
    assert outcomes.by_reason() == {"stop": 1, "length": 0, "abort": 1}
