"""Governance end to end: `kvgate up` (hf engine) plus a second `kvgate gateway` on the same Redis,
real keys made through /admin, real clients; limits must hold across both gateways."""
from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import orjson
import pytest
import redis

from tests.conftest import Stack, start_stack, stop_stack  # plain helpers (python -m pytest puts . on the path)

ROOT = Path(__file__).resolve().parents[2]
ENGINE = "hf"  # the gateway is under test here; the one-at-a-time baseline engine keeps timings plain
MARKER = "zebra-quartz-prompt-marker"  # a prompt that must never reach a log
# these tests fail authentication on purpose, many times, all from 127.0.0.1 (the throttle of failed
# authentication has its own test, tests/integration/test_admin_hardening.py)
THROTTLE_ENV = {"KVGATE_AUTH_FAILURES_PER_MINUTE": "100000"}
# a stream's 200 goes out at once, not when the one-at-a-time engine starts it, so a key's streams
# overlap as its slots do (test_never_a_fifth_request_in_flight)
STREAM_AT_ONCE = {"KVGATE_ADMISSION_WAIT_S": "0"}
RATE_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                "x-ratelimit-reset-requests", "x-ratelimit-limit-tokens",
                "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")


@dataclass
class Gov:
    stack: Stack
    gateways: list[str]
    admin_key: str
    second: subprocess.Popen
    secrets_made: list[str] = field(default_factory=list)

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.stack.url, timeout=30,
                            headers={"Authorization": f"Bearer {self.admin_key}"})

    def create_key(self, **fields) -> tuple[dict, str]:
        fields.setdefault("name", "k-" + secrets.token_hex(4))
        with self.admin() as admin:
            resp = admin.post("/admin/keys", json=fields)
        assert resp.status_code == 201, resp.text
        out = resp.json()
        self.secrets_made.append(out["secret"])
        return out["key"], out["secret"]


def _start_second_gateway(stack: Stack, admin_key: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "KVGATE_SECRET": (stack.state / "server.secret").read_text().strip(),
           "KVGATE_API_KEY": stack.key, "KVGATE_ADMIN_KEY": admin_key, **THROTTLE_ENV,
           **STREAM_AT_ONCE, "PROMETHEUS_MULTIPROC_DIR": str(stack.state / "metrics-gateway2")}
    log = open(stack.state / "gateway2.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "kvgate", "gateway", "--port", str(port),
                             "--redis-url", stack.redis_url], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, (stack.state / "gateway2.log").read_text()
        time.sleep(0.2)
    raise RuntimeError("second gateway did not become ready")


def _free_port() -> int:
    from shared.redis_server import free_port

    return free_port()


@pytest.fixture(scope="module")
def gov(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("gov")
    stack = start_stack(tiny_model_dir, root / ".kvgate", ENGINE, extra_env={**THROTTLE_ENV, **STREAM_AT_ONCE})
    admin_key = (stack.state / "admin.key").read_text().strip()
    second, url2 = _start_second_gateway(stack, admin_key)
    g = Gov(stack=stack, gateways=[stack.url, url2], admin_key=admin_key, second=second)
    yield g
    second.send_signal(signal.SIGTERM)
    second.wait(30)
    stop_stack(stack.proc)


def _auth(secret: str) -> dict:
    return {"Authorization": f"Bearer {secret}"}


def _completion(max_tokens: int = 1, prompt: str = "Hello world") -> dict:
    return {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}


async def _fire(requests: list[tuple[str, dict, dict]]) -> list[httpx.Response]:
    """All at once: (url, json body, headers) each."""
    limits = httpx.Limits(max_connections=len(requests) + 10)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*(client.post(u, json=b, headers=h) for u, b, h in requests))


# -- limits ----------------------------------------------------------------------------------
def test_rpm_admits_exactly_the_limit_over_two_gateways(gov):
    _, secret = gov.create_key(rpm=50)
    reqs = [(gov.gateways[i % 2] + "/v1/completions", _completion(), _auth(secret)) for i in range(200)]
    responses = asyncio.run(_fire(reqs))
    assert Counter(r.status_code for r in responses) == {200: 50, 429: 150}, [
        r.text for r in responses if r.status_code not in (200, 429)]
    for r in responses:
        assert all(h in r.headers for h in RATE_HEADERS), r.headers
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            err = r.json()["error"]
            assert err["type"] == "rate_limit_error" and "requests per minute" in err["message"]


def test_refused_requests_count_and_a_full_minute_is_refused_before_the_body(gov):
    """A generation refused for its body still takes one request of its key's minute; once a
    gateway heard the minute is full, the key's next POST there is refused before its body comes,
    until the minute moves on or the key's RPM changes."""
    record, secret = gov.create_key(rpm=3)
    url0, url1 = (u + "/v1/chat/completions" for u in gov.gateways)
    good = {"model": "demo", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(3):
        _error(httpx.post(url0, json={**good, "temperature": -1}, headers=_auth(secret)), 422)
    err = _error(httpx.post(url1, json=good, headers=_auth(secret)), 429)  # counted in Redis
    assert "requests per minute" in err["message"]
    host, port = gov.gateways[1].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # the body never comes
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer "
                     f"{secret}\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n".encode())
        head = sock.recv(4096).decode()
    assert head.startswith("HTTP/1.1 429") and "x-ratelimit-remaining-requests: 0" in head.lower(), head
    with gov.admin() as admin:
        assert admin.patch(f"/admin/keys/{record['name']}", json={"rpm": 10}).status_code == 200
    deadline = time.monotonic() + 5  # the key's new limit reaches the gateway within a second
    while (status := httpx.post(url1, json=good, headers=_auth(secret)).status_code) == 429:
        assert time.monotonic() < deadline, "a raised RPM was still refused from memory"
        time.sleep(0.1)
    assert status == 200


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(t, 1) for t, _ in intervals] + [(t, -1) for _, t in intervals],
                    key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


SKEW_S = 0.03


def test_never_a_fifth_request_in_flight(gov):
    """A stream's [headers, last byte] lies inside the gateway's [slot taken, slot released]."""
    _, secret = gov.create_key(max_concurrent=4)
    body = {"model": "demo", "stream": True, "max_tokens": 16, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}]}
    intervals: list[tuple[float, float]] = []
    refused = 0

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal refused
        while True:
            async with client.stream("POST", gov.gateways[i % 2] + "/v1/chat/completions",
                                     json=body, headers=_auth(secret)) as resp:
                if resp.status_code == 429:
                    refused += 1
                    await resp.aread()
                    await asyncio.sleep(0.01)
                    continue
                assert resp.status_code == 200
                start = time.monotonic()
                async for _ in resp.aiter_bytes():
                    pass
                intervals.append((start, time.monotonic()))
                return

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            await asyncio.gather(*(one(client, i) for i in range(16)))

    asyncio.run(run())
    assert len(intervals) == 16 and refused > 0
    # this client may handle the next stream's headers before the last byte of the stream whose
    # slot it took (one event loop, a loaded machine): up to SKEW_S of that is not an overlap; a
    # fifth stream really in flight would overlap the others for most of a stream (~0.1 s and more)
    assert _max_overlap([(start, end - SKEW_S) for start, end in intervals]) == 4


def test_a_disconnect_gives_the_slot_back(gov):
    _, secret = gov.create_key(max_concurrent=2)
    body = {"model": "demo", "stream": True, "max_tokens": 1500, "ignore_eos": True,
            "prompt": "go on"}

    async def open_and_leave(url: str) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", url + "/v1/completions", json=body,
                                     headers=_auth(secret)) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        break

    async def run() -> None:
        await asyncio.gather(*(open_and_leave(u) for u in gov.gateways))

    asyncio.run(run())
    deadline = time.monotonic() + 3  # far shorter than the 2 x 1500 tokens the streams asked for
    while time.monotonic() < deadline:
        resp = httpx.post(gov.gateways[0] + "/v1/completions", json=_completion(), headers=_auth(secret))
        if resp.status_code == 200:
            return
        assert "concurrent" in resp.json()["error"]["message"]
        time.sleep(0.05)
    pytest.fail("slots were not released when the clients disconnected")


def test_tpm_overshoot_is_at_most_one_request(gov):
    limit = 200
    _, secret = gov.create_key(tpm=limit)
    used, per_request, refused = 0, 0, []
    for _ in range(20):
        reqs = [(gov.gateways[i % 2] + "/v1/completions", _completion(max_tokens=4), _auth(secret))
                for i in range(8)]
        responses = asyncio.run(_fire(reqs))
        for r in responses:
            if r.status_code == 200:
                total = r.json()["usage"]["total_tokens"]
                used, per_request = used + total, max(per_request, total)
            else:
                refused.append(r)
        if refused:
            break
    assert refused, "the token limit was never reached"
    assert all(r.status_code == 429 and "tokens per minute (TPM)" in r.json()["error"]["message"]
               for r in refused)
    assert limit - per_request < used <= limit + per_request


def test_daily_budget_refuses_with_its_own_message(gov):
    _, secret = gov.create_key(daily_tokens=20)
    codes = []
    for url in gov.gateways * 3:
        resp = httpx.post(url + "/v1/completions", json=_completion(max_tokens=4), headers=_auth(secret))
        codes.append(resp.status_code)
        if resp.status_code == 429:
            err = resp.json()["error"]
            assert err["code"] == "insufficient_quota" and "Daily token budget" in err["message"]
    assert codes[:2] == [200, 200] and 429 in codes


# -- keys --------------------------------------------------------------------------------------
def _status(url: str, secret: str) -> int:
    return httpx.get(url + "/v1/models", headers=_auth(secret), timeout=5).status_code


def test_revoked_key_is_refused_by_both_gateways_within_a_second(gov):
    record, secret = gov.create_key()
    assert [_status(u, secret) for u in gov.gateways] == [200, 200]
    with gov.admin() as admin:
        assert admin.post(f"/admin/keys/{record['name']}/revoke").json()["status"] == "revoked"
    revoked_at = time.monotonic()
    pending = set(gov.gateways)
    while pending and time.monotonic() - revoked_at < 1.0:
        pending = {u for u in pending if _status(u, secret) != 401}
    assert not pending, f"still accepted after 1 s by {pending}"
    resp = httpx.get(gov.gateways[1] + "/v1/models", headers=_auth(secret))
    assert resp.json()["error"]["code"] == "key_revoked"


def test_rotated_key_old_secret_works_only_during_grace(gov):
    record, old = gov.create_key()
    with gov.admin() as admin:
        resp = admin.post(f"/admin/keys/{record['id']}/rotate", json={"grace_s": 2})
    rotated_at = time.monotonic()
    new = resp.json()["secret"]
    gov.secrets_made.append(new)
    assert new != old
    assert [_status(u, s) for u in gov.gateways for s in (old, new)] == [200] * 4
    time.sleep(max(0.0, rotated_at + 2.5 - time.monotonic()))
    assert [_status(u, old) for u in gov.gateways] == [401, 401]
    assert [_status(u, new) for u in gov.gateways] == [200, 200]


def test_every_documented_route_but_health_needs_a_key(gov):
    doc = httpx.get(gov.stack.url + "/openapi.json").json()
    _, user_secret = gov.create_key()
    checked = 0
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if "health" in op.get("tags", []) or path == "/metrics":
                continue
            url = gov.stack.url + path.replace("{", "").replace("}", "")
            for headers, want in (({}, 401), (_auth("sk-kvg-not-a-key"), 401)):
                resp = httpx.request(method, url, json={}, headers=headers)
                assert resp.status_code == want, (method, path, resp.text)
                assert resp.json()["error"]["type"] == "authentication_error"
            if path.startswith("/admin"):
                for secret in (user_secret, gov.stack.key):
                    resp = httpx.request(method, url, json={}, headers=_auth(secret))
                    assert resp.status_code == 403, (method, path, resp.text)
            checked += 1
    assert checked >= 9
    _, admin_secret = gov.create_key(role="admin")
    resp = httpx.get(gov.gateways[1] + "/admin/keys", headers=_auth(admin_secret))
    assert resp.status_code == 200 and resp.json()["data"]


# -- concurrent admin writes (two gateways, one Redis) -----------------------------------------
def _admin_fire(gov: Gov, calls: list[tuple[str, str, dict | None]]) -> list[httpx.Response]:
    """All at once, alternating gateways: (method, path, json body) each."""
    async def run() -> list[httpx.Response]:
        headers = {"Authorization": f"Bearer {gov.admin_key}"}
        limits = httpx.Limits(max_connections=len(calls) + 10)
        async with httpx.AsyncClient(timeout=60, limits=limits, headers=headers) as client:
            return await asyncio.gather(*(
                client.request(method, gov.gateways[i % 2] + path, json=body)
                for i, (method, path, body) in enumerate(calls)))
    return asyncio.run(run())


def test_patch_racing_revoke_never_reactivates_a_key(gov):
    keys = [gov.create_key()[0] for _ in range(50)]
    calls = [c for k in keys for c in (("PATCH", f"/admin/keys/{k['id']}", {"rpm": 77}),
                                       ("POST", f"/admin/keys/{k['id']}/revoke", None))]
    responses = _admin_fire(gov, calls)
    assert [r.status_code for r in responses] == [200] * len(calls), [r.text for r in responses]
    with gov.admin() as admin:
        after = [admin.get(f"/admin/keys/{k['id']}").json() for k in keys]
    assert all(k["status"] == "revoked" and k["revoked"] for k in after)
    assert all(k["rpm"] in (None, 77) for k in after)
    client = redis.Redis.from_url(gov.stack.redis_url)
    stored = [orjson.loads(client.hget(f"kvgate:key:{k['id']}", "record")) for k in keys]
    client.close()
    assert {s["status"] for s in stored} == {"revoked"}


def _digest_ttls(gov: Gov, key_id: str, secrets_: list[str]) -> tuple[str, dict[str, int]]:
    """The key's current digest, and the TTL of every digest of `secrets_` (-2: gone)."""
    import hashlib
    import hmac

    server_secret = (gov.stack.state / "server.secret").read_text().strip().encode()
    client = redis.Redis.from_url(gov.stack.redis_url)
    current = client.hget(f"kvgate:key:{key_id}", "digest").decode()
    digests = [hmac.new(server_secret, s.encode(), hashlib.sha256).hexdigest() for s in secrets_]
    ttls = {d: client.ttl(f"kvgate:keydigest:{d}") for d in digests}
    client.close()
    return current, ttls


@pytest.mark.parametrize("grace_s", [30, 0])
def test_concurrent_rotations_leave_one_current_secret(gov, grace_s):
    record, first = gov.create_key()
    responses = _admin_fire(gov, [("POST", f"/admin/keys/{record['id']}/rotate",
                                   {"grace_s": grace_s})] * 20)
    assert [r.status_code for r in responses] == [200] * 20, [r.text for r in responses]
    made = [first] + [r.json()["secret"] for r in responses]
    gov.secrets_made.extend(made[1:])
    current, ttls = _digest_ttls(gov, record["id"], made)
    assert ttls[current] == -1
    assert [d for d, ttl in ttls.items() if ttl == -1] == [current]  # the only digest without a TTL
    assert all(-2 < ttl <= grace_s if grace_s else ttl == -2 for d, ttl in ttls.items() if d != current)
    statuses = [_status(gov.gateways[i % 2], s) for i, s in enumerate(made)]
    if grace_s == 0:
        assert sorted(statuses) == [200] + [401] * 20  # only the current secret authenticates
    else:
        assert all(s == 200 for s in statuses)  # every rotated-out secret within its grace


# -- usage and validation ------------------------------------------------------------------
def test_usage_totals_equal_what_clients_were_told(gov):
    record, secret = gov.create_key()
    clients = [openai.OpenAI(base_url=u + "/v1", api_key=secret, max_retries=0, timeout=60)
               for u in gov.gateways]
    told = Counter()
    for i, client in enumerate(clients * 3):
        extra = {"ignore_eos": True}
        msgs = [{"role": "user", "content": f"{MARKER} {i}"}]
        usages = [client.chat.completions.create(model="demo", messages=msgs, max_tokens=1 + i % 4,
                                                  extra_body=extra).usage,
                  client.completions.create(model="demo", prompt=f"{MARKER} {i}", max_tokens=2,
                                            extra_body=extra).usage]
        stream = client.chat.completions.create(model="demo", messages=msgs, max_tokens=3, stream=True,
                                                stream_options={"include_usage": True}, extra_body=extra)
        usages += [c.usage for c in stream if c.usage is not None]
        for u in usages:
            told.update(requests=1, prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens)
    with gov.admin() as admin:
        by_model = admin.get("/admin/usage", params={"key": record["name"], "since": "1d"}).json()
        by_day = admin.get("/admin/usage", params={"key": record["name"], "by": "day"}).json()
    assert [(r["model"], r["version"]) for r in by_model["rows"]] == [("demo", "v1")]
    for report in (by_model, by_day):
        row = report["rows"][0]
        assert (row["requests"], row["prompt_tokens"], row["completion_tokens"], row["errors"]) == (
            told["requests"], told["prompt_tokens"], told["completion_tokens"], 0)
        assert row["total_tokens"] == told["prompt_tokens"] + told["completion_tokens"]


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_validation_errors(gov):
    url = gov.gateways[1] + "/v1/chat/completions"
    good = {"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    _, narrow = gov.create_key(models=["other"])
    err = _error(httpx.post(url, json=good, headers=_auth(narrow)), 403)
    assert err["param"] == "model" and "demo" in err["message"]
    err = _error(httpx.post(url, json={**good, "max_tokens": 100000}, headers=_auth(gov.stack.key)), 400)
    assert err["param"] == "max_tokens" and "100000" in err["message"] and "2048" in err["message"]
    ids = list(range(1, 50))
    err = _error(httpx.post(gov.gateways[0] + "/v1/completions", headers=_auth(gov.stack.key),
                            json={"model": "demo", "prompt": ids, "max_tokens": 2000}), 400)
    assert "2049" in err["message"] and err["code"] == "context_length_exceeded"
    for param, value in (("top_p", 0), ("temperature", -1), ("n", 0), ("presence_penalty", 3),
                         ("max_tokens", 0)):
        err = _error(httpx.post(url, json={**good, param: value}, headers=_auth(gov.stack.key)), 422)
        assert err["param"] == param and err["type"] == "invalid_request_error"
    _, short_lived = gov.create_key(expires_in=1)
    assert _status(gov.gateways[0], short_lived) == 200
    time.sleep(1.1)
    err = _error(httpx.get(gov.gateways[1] + "/v1/models", headers=_auth(short_lived)), 401)
    assert err["code"] == "key_expired"


def test_every_v1_response_carries_rate_limit_headers(gov):
    _, secret = gov.create_key(rpm=100, tpm=5000)
    h = _auth(secret)
    responses = [httpx.get(gov.gateways[0] + "/v1/models", headers=h),
                 httpx.get(gov.gateways[1] + "/v1/models/demo", headers=h),
                 httpx.get(gov.gateways[1] + "/v1/models/nope", headers=h),
                 httpx.post(gov.gateways[0] + "/v1/completions", json=_completion(), headers=h),
                 httpx.post(gov.gateways[1] + "/v1/completions", json={**_completion(), "stream": True},
                            headers=h)]
    for r in responses:
        assert all(name in r.headers for name in RATE_HEADERS), (r.status_code, r.headers)
        assert r.headers["x-ratelimit-limit-requests"] == "100"
        assert r.headers["x-ratelimit-limit-tokens"] == "5000"
    remaining = [int(r.headers["x-ratelimit-remaining-requests"]) for r in responses]
    assert remaining == [99, 98, 97, 96, 95]


def test_a_served_name_with_a_slash_is_found_by_its_id(gov):
    """Served names as the Hub spells them (`--served-name meta-llama/Llama-3.2-1B`): the openai
    client's models.retrieve sends the slash as it is."""
    import orjson
    import redis

    from shared import names

    name, worker_id = "org-" + secrets.token_hex(3) + "/Tiny-1B", "w-slash-" + secrets.token_hex(3)
    client = redis.Redis.from_url(gov.stack.redis_url)  # a live worker of that name, as its heartbeat says
    client.set(names.worker_key(worker_id), orjson.dumps({"worker_id": worker_id, "served_name": name,
                                                          "version": "v1", "ts": time.time()}), ex=30)
    client.zadd(names.WORKERS_ZSET, {worker_id: time.time() + 30})
    _, secret = gov.create_key()
    try:
        deadline = time.monotonic() + 10  # the gateway's list of live workers is cached briefly
        while (resp := httpx.get(f"{gov.gateways[0]}/v1/models/{name}", headers=_auth(secret))).status_code != 200:
            assert resp.status_code == 404 and time.monotonic() < deadline, resp.text
            time.sleep(0.2)
        assert resp.json()["id"] == name
        assert _error(httpx.get(f"{gov.gateways[0]}/v1/models/{name}x", headers=_auth(secret)), 404)
    finally:
        client.zrem(names.WORKERS_ZSET, worker_id)
        client.delete(names.worker_key(worker_id))
        client.close()


# -- the CLI -----------------------------------------------------------------------------------
def _cli(gov: Gov, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("KVGATE_URL", "KVGATE_ADMIN_KEY")}
    # run from the stack's folder (where .kvgate/ is), with this checkout's code, not the install's
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-m", "kvgate", *args], cwd=gov.stack.state.parent, env=env,
                         capture_output=True, text=True, timeout=60)
    assert (out.returncode == 0) == ok, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    return out


def test_cli_end_to_end(gov):
    created = _cli(gov, "keys", "create", "--name", "cli-alice", "--models", "demo", "--rpm", "60",
                   "--tpm", "100000", "--max-concurrent", "4", "--daily-tokens", "2000000",
                   "--expires", "30d", "--best-priority", "-5", "--cache-scope", "key")
    secret = created.stdout.strip().splitlines()[-1]
    assert secret.startswith("sk-kvg-") and created.stdout.strip() == secret
    gov.secrets_made.append(secret)
    import json

    listed = json.loads(_cli(gov, "keys", "list", "--json").stdout)
    alice = next(k for k in listed if k["name"] == "cli-alice")
    assert (alice["rpm"], alice["max_concurrent"], alice["models"]) == (60, 4, ["demo"])
    assert (alice["best_priority"], alice["cache_scope"]) == (-5, "key")
    updated = json.loads(_cli(gov, "keys", "update", "cli-alice", "--cache-scope", "shared",
                              "--best-priority", "10", "--json").stdout)
    assert (updated["best_priority"], updated["cache_scope"]) == (10, "shared")
    default, _ = gov.create_key()  # made without either field
    assert (default["best_priority"], default["cache_scope"]) == (0, "tenant")
    assert "cli-alice" in _cli(gov, "keys", "list").stdout
    client = openai.OpenAI(base_url=gov.gateways[1] + "/v1", api_key=secret, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError, match="priority 10 or higher"):
        client.completions.create(model="demo", prompt=MARKER, max_tokens=2)  # asks for 0
    resp = client.completions.create(model="demo", prompt=MARKER, max_tokens=2, extra_body={"priority": 10})
    usage = json.loads(_cli(gov, "usage", "--key", "cli-alice", "--json").stdout)
    assert usage["rows"][0]["total_tokens"] == resp.usage.total_tokens
    assert "cli-alice" in _cli(gov, "keys", "revoke", "cli-alice").stdout
    with pytest.raises(openai.AuthenticationError, match="revoked"):
        client.completions.create(model="demo", prompt="x", max_tokens=1)
    assert "revoked" in _cli(gov, "keys", "show", "cli-alice").stdout


def test_cli_says_what_went_wrong(gov):
    assert "No API key named 'nobody'" in _cli(gov, "keys", "show", "nobody", ok=False).stderr
    assert "cannot reach the gateway" in _cli(gov, "keys", "list", "--url", "http://127.0.0.1:9",
                                              ok=False).stderr
    assert "refused the admin key" in _cli(gov, "keys", "list", "--admin-key", "sk-kvg-wrong",
                                           ok=False).stderr
    assert "not an admin key" in _cli(gov, "keys", "list", "--admin-key", gov.stack.key, ok=False).stderr


# -- nothing leaks (last: it reads what every test above left behind) ------------------------
def test_secrets_and_prompts_never_reach_logs_or_redis(gov):
    logs = {p.name: p.read_text(errors="replace") for p in gov.stack.state.glob("*.log")}
    assert {"gateway.log", "gateway2.log", "worker.log"} <= set(logs)
    server_secret = (gov.stack.state / "server.secret").read_text().strip()
    forbidden = [*gov.secrets_made, gov.stack.key, gov.admin_key, server_secret, MARKER]
    for name, text in logs.items():
        for value in forbidden:
            assert value not in text, f"{name} holds a secret or a prompt"
    client = redis.Redis.from_url(gov.stack.redis_url)
    dump = b""
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        if kind == b"string":
            dump += client.get(key) or b""
        elif kind == b"hash":
            dump += b"".join(k + v for k, v in client.hgetall(key).items())
        elif kind == b"list":
            dump += b"".join(client.lrange(key, 0, -1))
        elif kind == b"set":
            dump += b"".join(client.smembers(key))
        elif kind == b"zset":
            dump += b"".join(client.zrange(key, 0, -1))
    for value in (*gov.secrets_made, gov.stack.key, gov.admin_key, server_secret):
        assert value.encode() not in dump, "a secret is stored in Redis"
    record_keys = list(client.scan_iter(match="kvgate:key:*"))
    assert record_keys and all(set(client.hkeys(k)) == {b"record", b"digest"} for k in record_keys)
    client.close()
