"""The circuit breaker across two gateway processes (issue 21): a version whose worker fails every
request (`--fault-error-rate 1.0`) opens its breaker at one gateway; the other refuses it at once
with 503 + Retry-After; after KVGATE_BREAKER_OPEN_S one probe tries it (and reopens it while the
fault lasts); once the worker is restarted without the fault, the probe's first token closes it.
"""
from __future__ import annotations

import signal
import time

import httpx

from shared import names
from tests.integration.test_faults import HEADERS, Cluster

OPEN_S = 2.0
BREAKER = {"KVGATE_BREAKER_FAILURES": "3", "KVGATE_BREAKER_WINDOW_S": "60",
           "KVGATE_BREAKER_OPEN_S": str(OPEN_S)}


def _ask(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers=HEADERS, timeout=30,
                      json={"model": "demo", "prompt": "hello", "max_tokens": 4, "temperature": 0})


def _state(cluster: Cluster) -> str:
    raw = cluster.client.hget(names.breaker_state("demo", "v1"), "state")
    return raw.decode() if raw else "closed"


def _metric(url: str, line_start: str) -> str:
    return next((line for line in httpx.get(url + "/metrics", timeout=10).text.splitlines()
                 if line.startswith(line_start)), "")


def test_breaker_opens_is_shared_probes_and_closes_once_the_fault_is_gone(tmp_path, tiny_model_dir):
    cluster = Cluster(tmp_path, tiny_model_dir)
    try:
        cluster.start_gateway(**BREAKER)
        a = cluster.url
        cluster.start_gateway(**BREAKER)
        b = cluster.url
        faulty = cluster.start_worker("w1", "--fault-error-rate", "1.0")
        # each failure counts, the one a retry absorbed too: 2 per request until the third opens it
        first, second = _ask(a), _ask(a)
        assert (first.status_code, second.status_code) == (500, 500), (first.text, second.text)
        assert _state(cluster) == "open"
        refused = _ask(b)  # the other gateway: at once, without touching the worker
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "circuit_open" and "'demo' version 'v1'" in error["message"]
        assert 1 <= int(refused.headers["Retry-After"]) <= OPEN_S
        assert _metric(b, 'kvgate_gateway_breaker_state{model="demo",version="v1"}').endswith(" 1.0")
        assert _metric(a, 'kvgate_gateway_breaker_transitions_total{model="demo",to="open",version="v1"}')

        time.sleep(OPEN_S + 0.2)  # the probe goes through, fails while the fault lasts: open again
        probe = _ask(b)
        assert probe.status_code == 500 and probe.json()["error"]["code"] == "engine_error", probe.text
        assert _state(cluster) == "open" and _ask(a).status_code == 503

        faulty.send_signal(signal.SIGTERM)  # the worker restarted without the fault
        faulty.wait(30)
        cluster.client.delete(names.worker_key("w1"))
        cluster.start_worker("w2")
        time.sleep(OPEN_S + 0.2)
        healed = _ask(a)
        assert healed.status_code == 200, healed.text
        assert _state(cluster) == "closed"  # the probe's first token closed it before it was sent
        assert [_ask(url).status_code for url in (a, b, a, b)] == [200] * 4
        assert _metric(b, 'kvgate_gateway_breaker_state{model="demo",version="v1"}').endswith(" 0.0")
        closed = _metric(a, 'kvgate_gateway_breaker_transitions_total{model="demo",to="closed",version="v1"}')
        assert closed.endswith(" 1.0"), closed
    finally:
        cluster.close()
