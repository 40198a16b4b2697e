"""Canary releases end to end: `kvgate up` (hf engine; its Celery worker and beat checking every
second) plus more `kvgate worker` processes serving other versions of `demo`; routes set and read
with the `kvgate canary` CLI, traffic from real keys over HTTP."""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import pytest
import redis

from shared import canary, names
from tests.conftest import Stack, start_stack, stop_stack

ENGINE = "hf"
ALIAS = "demo"


@dataclass
class Env:
    stack: Stack
    model_dir: Path
    admin_key: str
    http: httpx.Client
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start_worker(self, version: str, *flags: str) -> subprocess.Popen:
        log = open(self.stack.state / f"worker-{version}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvgate", "worker", "--model", str(self.model_dir), "--served-name",
             ALIAS, "--version", version, "--engine", ENGINE, "--redis-url", self.stack.redis_url,
             *flags], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.workers[version] = proc
        deadline = time.monotonic() + 120
        while version not in self.live_versions():
            assert proc.poll() is None, (self.stack.state / f"worker-{version}.log").read_text()
            assert time.monotonic() < deadline, f"worker {version} did not come up"
            time.sleep(0.2)
        return proc

    def live_versions(self) -> set[str]:
        client = redis.Redis.from_url(self.stack.redis_url)
        try:
            ids = client.zrangebyscore(names.WORKERS_ZSET, time.time(), "+inf")
            infos = [orjson.loads(i) for i in client.mget([names.worker_key(i.decode()) for i in ids])
                     if i] if ids else []
        finally:
            client.close()
        return {w["version"] for w in infos if w["ts"] > time.time() - 2}

    def key(self, **fields) -> tuple[dict, str]:
        resp = self.http.post("/admin/keys", json={"name": "c-" + secrets.token_hex(4), **fields},
                              headers=_auth(self.admin_key))
        assert resp.status_code == 201, resp.text
        return resp.json()["key"], resp.json()["secret"]

    def ask(self, secret: str, version: str | None = None, stream: bool = False) -> httpx.Response:
        headers = {**_auth(secret), **({"x-kvgate-version": version} if version else {})}
        body = {"model": ALIAS, "prompt": "Hello", "max_tokens": 2, "ignore_eos": True,
                "stream": stream}
        return self.http.post("/v1/completions", json=body, headers=headers)

    def route(self) -> dict:
        return self.http.get(f"/admin/canary/{ALIAS}", headers=_auth(self.admin_key)).json()


def _auth(secret: str) -> dict:
    return {"Authorization": f"Bearer {secret}"}


def _cli(env: Env, *args: str, ok: bool = True) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("KVGATE_URL", "KVGATE_ADMIN_KEY")}
    out = subprocess.run([sys.executable, "-m", "kvgate", *args], cwd=env.stack.state.parent,
                         env=clean, capture_output=True, text=True, timeout=60)
    assert (out.returncode == 0) == ok, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    return out.stdout if ok else out.stderr


def _follows(env: Env, secret: str, version: str, since: float) -> None:
    """Requests with `secret` reach `version` within a second of `since` (every gateway's cache)."""
    while (resp := env.ask(secret)).headers.get("x-kvgate-version") != version:
        assert time.monotonic() - since < 1.0, f"still not on {version}"
    _served(resp)


def _served(resp: httpx.Response) -> str:
    """The version a successful response came from (a stream must end cleanly)."""
    assert resp.status_code == 200, resp.text
    if resp.headers["content-type"].startswith("text/event-stream"):
        assert resp.text.rstrip().endswith("data: [DONE]") and '"error"' not in resp.text, resp.text
    return resp.headers["x-kvgate-version"]


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("canary")
    stack = start_stack(tiny_model_dir, root / ".kvgate", ENGINE, {"KVGATE_CANARY_CHECK_S": "1"})
    e = Env(stack=stack, model_dir=tiny_model_dir, http=httpx.Client(base_url=stack.url, timeout=60),
            admin_key=(stack.state / "admin.key").read_text().strip())
    try:
        e.start_worker("v2")
        yield e
    finally:
        for proc in e.workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
        e.http.close()
        stop_stack(stack.proc)


def test_sticky_split_cohort_and_version_header(env):
    _cli(env, "canary", "set", ALIAS, "--version", "v2", "--weight", "50")
    plain, expected = [], {}
    while list(expected.values()).count("v1") < 2 or list(expected.values()).count("v2") < 2:
        plain.append(env.key())
        key_id = plain[-1][0]["id"]
        expected[key_id] = "v2" if canary.bucket(key_id, ALIAS) < 5000 else "v1"
    for record, secret in plain:
        assert [_served(env.ask(secret, stream=s)) for s in (False, True, False)] == \
            [expected[record["id"]]] * 3
    _, cohort = env.key(canary_cohort="canary")
    _, stable_cohort = env.key(canary_cohort="stable")
    assert {_served(env.ask(cohort)) for _ in range(3)} == {"v2"}
    assert {_served(env.ask(stable_cohort)) for _ in range(3)} == {"v1"}

    refused = env.ask(plain[0][1], version="v2")
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "version_override_not_allowed"
    secret = _cli(env, "keys", "create", "--name", "tester-" + secrets.token_hex(3),
                  "--version-override").strip().splitlines()[-1]
    assert [_served(env.ask(secret, version=v)) for v in ("v1", "v2", "v1")] == ["v1", "v2", "v1"]
    assert _served(env.ask(env.admin_key, version="v2")) == "v2"
    assert env.ask(env.admin_key, version="v9").status_code == 404


def test_failing_canary_is_rolled_back_by_the_beat_and_status_says_why(env):
    _cli(env, "canary", "set", ALIAS, "--version", "v3", "--weight", "50", "--steps", "50,100",
         "--interval", "1s", "--min-samples", "10", "--window", "60s")  # before v3 has a worker
    _, cohort = env.key(canary_cohort="canary")
    _follows(env, cohort, "v1", time.monotonic())  # stable, until v3 is up
    env.start_worker("v3", "--fault-error-rate", "0.5", "--fault-latency-ms", "100")
    statuses, deadline = [], time.monotonic() + 60  # within the analysis window
    while env.route()["route"]["phase"] == "canary":
        assert time.monotonic() < deadline, f"not rolled back: {env.route()}"
        resp = env.ask(cohort)
        statuses.append(resp.status_code)
        if resp.status_code == 500:  # errors too name the version that answered
            assert resp.headers["x-kvgate-version"] == "v3"
        if len(statuses) > 10:
            time.sleep(0.1)
    # a failed request is retried on the stable version before its first token (gateway/retry.py),
    # so clients mostly see 200s; the canary's failures still count, and roll it back
    assert 200 in statuses and set(statuses) <= {200, 500}, statuses
    _follows(env, cohort, "v1", time.monotonic())
    status = _cli(env, "canary", "status", ALIAS)
    assert "rolled back because: success rate" in status and "< 99.0%" in status, status
    assert "rollbacks 1" in status
    out = json.loads(_cli(env, "canary", "status", ALIAS, "--json"))
    assert out["route"]["weight"] == 0 and out["route"]["canary"] == "v3"
    assert out["versions"]["v3"]["ttft_p95_ms"] >= 100 and out["versions"]["v3"]["errors"] > 0
    assert [e["kind"] for e in out["events"]][:2] == ["rollback", "set"]  # never advanced
    env.workers["v3"].send_signal(signal.SIGTERM)


def test_staged_rollout_advances_while_passing_then_promotes(env):
    _cli(env, "canary", "set", ALIAS, "--version", "v2", "--stable", "v1", "--steps", "20,60,100",
         "--interval", "2s", "--min-samples", "5", "--max-ttft-ratio", "50", "--window", "60s")
    time.sleep(3)  # an interval has passed, but without traffic there is nothing to judge
    assert env.route()["route"]["weight"] == 20
    _, cohort = env.key(canary_cohort="canary")
    _, plain = env.key(canary_cohort="stable")
    deadline = time.monotonic() + 40
    while (route := env.route()["route"])["phase"] == "canary":
        assert time.monotonic() < deadline, f"not promoted: {env.route()}"
        _served(env.ask(cohort))
        _served(env.ask(plain))
    promoted_at = time.monotonic()
    assert (route["stable"], route["canary"], route["phase"]) == ("v2", None, "promoted")
    kinds = [e["kind"] for e in env.route()["events"]]
    assert kinds[:3] == ["promote", "advance", "set"], kinds
    _, anyone = env.key()
    _follows(env, anyone, "v2", promoted_at)


def test_promote_makes_the_canary_stable(env):
    _cli(env, "canary", "set", ALIAS, "--version", "v1", "--weight", "10", "--min-samples", "1000")
    assert "demo: stable v2, canary v1 (canary), weight 10%" in _cli(env, "canary", "status", ALIAS)
    _, anyone = env.key()
    out = _cli(env, "canary", "promote", ALIAS)
    assert "stable v1, canary -" in out
    _follows(env, anyone, "v1", time.monotonic())
    assert "no canary on trial" in _cli(env, "canary", "rollback", ALIAS, ok=False)


def test_a_version_no_worker_ever_served_is_never_promoted(env):
    # a canary may be set before its workers start; promoted then, it left the alias no worker
    admin = _auth(env.admin_key)
    resp = env.http.put(f"/admin/canary/{ALIAS}", json={"version": "v-unborn", "stable": "v1"},
                        headers=admin)
    assert resp.status_code == 200, resp.text
    resp = env.http.post(f"/admin/canary/{ALIAS}/promote", headers=admin)
    assert resp.status_code == 409, resp.text
    assert resp.json()["error"]["code"] == "version_not_served" and "v-unborn" in resp.text
    assert env.route()["route"]["stable"] == "v1" and env.route()["route"]["phase"] == "canary"
    _, anyone = env.key()
    assert _served(env.ask(anyone)) == "v1"
    assert env.http.post(f"/admin/canary/{ALIAS}/rollback", headers=admin).status_code == 200


def test_pause_and_resume_twice_change_nothing_the_second_time(env):
    """Resuming a canary that is not paused must not restart its step's interval (it would put off
    the next step), and neither repeat writes an event."""
    _cli(env, "canary", "set", ALIAS, "--version", "v2", "--stable", "v1", "--weight", "10",
         "--min-samples", "1000")
    admin, before = _auth(env.admin_key), env.route()
    resp = env.http.post(f"/admin/canary/{ALIAS}/resume", headers=admin)
    assert resp.status_code == 200, resp.text
    after = env.route()
    assert after["route"]["step_started"] == before["route"]["step_started"]
    assert len(after["events"]) == len(before["events"])
    for _ in range(2):
        assert env.http.post(f"/admin/canary/{ALIAS}/pause", headers=admin).json()["paused"] is True
    kinds = [e["kind"] for e in env.route()["events"]]
    assert kinds.count("pause") == 1 + [e["kind"] for e in before["events"]].count("pause"), kinds
    assert env.http.post(f"/admin/canary/{ALIAS}/rollback", headers=admin).status_code == 200


def test_killing_the_canary_workers_sends_traffic_to_stable_without_errors(env):
    _cli(env, "canary", "set", ALIAS, "--version", "v2", "--stable", "v1", "--weight", "100",
         "--min-samples", "1000")
    _, secret = env.key()
    _follows(env, secret, "v2", time.monotonic())
    assert [_served(env.ask(secret, stream=i % 2 == 1)) for i in range(4)] == ["v2"] * 4
    env.workers["v2"].send_signal(signal.SIGKILL)
    env.workers["v2"].wait()
    served = [_served(env.ask(secret, stream=i % 2 == 1)) for i in range(6)]  # all 200, no error
    assert served[-1] == "v1", served
    counters = env.route()["counters"]
    assert counters["failovers"] >= 1, counters
    assert counters.get("rescued", 0) >= 1, counters  # queued for v2 before its death was seen
