"""Time limits per route and per key, enforced end to end (issue 21): when the gateway gives up it
answers 504 (`ttft_timeout` or `timeout`, naming the limit) and cancels, and the worker frees the
request's KV. Real processes (tests/integration/test_faults.py's Cluster); the worker is made slow
with `--fault-latency-ms` (before admission) and KVGATE_FAULT_STEP_MS (a pause per engine step)."""
from __future__ import annotations

import time

import httpx
import orjson
from click.testing import CliRunner

from kvgate.cli import main
from tests.integration.test_faults import KEY, Cluster, cluster  # noqa: F401  (the fixture)

ADMIN = "sk-kvg-timeout-admin"
LATENCY_S = 2.0  # the worker's pause before it admits a request


def _keys(c: Cluster, *args: str) -> dict:
    result = CliRunner().invoke(main, ["keys", *args, "--url", c.url, "--admin-key", ADMIN, "--json"])
    assert result.exit_code == 0, result.output
    return orjson.loads(result.output)


def _post(c: Cluster, path: str, body: dict, key: str = KEY) -> tuple[int, float, list[dict]]:
    """Status, seconds to the answer's end, and the error bodies or SSE error events seen."""
    start, errors = time.monotonic(), []
    with httpx.stream("POST", c.url + path, json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=60) as resp:
        if resp.status_code != 200:
            errors.append(orjson.loads(resp.read())["error"])
        else:
            for line in resp.iter_lines():
                if line.startswith("data: {") and '"error"' in line:
                    errors.append(orjson.loads(line[6:])["error"])
        return resp.status_code, time.monotonic() - start, errors


def _idle_again(c: Cluster, idle: dict) -> dict:
    """The worker's registry once it runs nothing and every block is free again."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        info = c.info("w1")
        if info["active"] == 0 and info["stats"]["num_free_blocks"] == idle["num_free_blocks"]:
            return info
        time.sleep(0.1)
    return c.info("w1")


def test_route_and_key_timeouts_answer_504_cancel_and_free_the_kv(cluster):  # noqa: F811
    c = cluster
    c.start_gateway(KVGATE_ADMIN_KEY=ADMIN, KVGATE_ROUTE_TIMEOUTS='{"completions": {"ttft_s": 1}}')
    c.start_worker("w1", "--fault-latency-ms", str(int(LATENCY_S * 1000)), KVGATE_FAULT_STEP_MS="20")
    idle = c.info("w1")["stats"]
    short = {"model": "demo", "max_tokens": 4}

    # the completions route's first-token limit: an HTTP 504 before the stream's 200, then a cancel
    status, took, errors = _post(c, "/v1/completions", {**short, "prompt": "hi", "stream": True})
    assert status == 504 and errors[0]["code"] == "ttft_timeout", errors
    assert "KVGATE_ROUTE_TIMEOUTS[completions]" in errors[0]["message"] and took < LATENCY_S
    # chat has no such limit: the same slow worker serves it
    status, took, _ = _post(c, "/v1/chat/completions",
                            {**short, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and took >= LATENCY_S

    # a key's total limit: the stream has started (blocks in use) when the gateway gives up
    secret = _keys(c, "create", "--name", "slow", "--request-timeout", str(LATENCY_S + 2))["secret"]
    long = {"model": "demo", "messages": [{"role": "user", "content": "go"}], "max_tokens": 2000,
            "ignore_eos": True, "stream": True}
    status, took, errors = _post(c, "/v1/chat/completions", long, key=secret)
    assert status == 200 and errors and errors[0]["code"] == "timeout", errors
    assert "key 'slow' request_timeout_s" in errors[0]["message"] and took < LATENCY_S + 4
    info = _idle_again(c, idle)
    print(f"\n[timeouts] ttft 504 and total 504 mid-stream; worker aborted {info['requests_aborted']}, "
          f"active {info['active']}, free blocks {info['stats']['num_free_blocks']}/{idle['num_blocks']}")
    assert info["requests_aborted"] >= 1 and info["active"] == 0
    assert info["stats"]["num_free_blocks"] == idle["num_free_blocks"]

    # the key's own first-token limit replaces the route's: 0 lifts it, so completions are served
    record = _keys(c, "update", "slow", "--ttft-timeout", "0", "--clear", "request-timeout")
    assert record["ttft_timeout_s"] == 0 and record["request_timeout_s"] is None
    status, _, errors = _post(c, "/v1/completions", {**short, "prompt": "hi"}, key=secret)
    assert status == 200, errors
