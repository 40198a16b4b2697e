"""The gateway on its own (`kvgate gateway` + a real Redis, no worker): failed authentication is
throttled per client address, and every admin input out of range is a 4xx in OpenAI's shape.

Each test talks from its own loopback address (127.0.0.x), so the per-address budgets of one test
never touch another's.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time

import httpx
import pytest

from shared.redis_server import RedisServer, free_port

ADMIN = "sk-kvg-hardening-admin"
FAILURES_PER_MINUTE = 5
PUBLIC_PER_MINUTE = 20
RETENTION_DAYS = 3


class Gateway:
    def __init__(self, url: str):
        self.url = url

    def client(self, address: str, key: str | None = ADMIN) -> httpx.Client:
        """A client whose requests come from `address` (a loopback address of its own)."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30,
                            transport=httpx.HTTPTransport(local_address=address))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    server = RedisServer(port=free_port(), data_dir=root / "redis").start()
    port = free_port()
    env = {**os.environ, "KVGATE_SECRET": "hardening-secret", "KVGATE_ADMIN_KEY": ADMIN,
           "KVGATE_AUTH_FAILURES_PER_MINUTE": str(FAILURES_PER_MINUTE),
           "KVGATE_PUBLIC_PER_MINUTE": str(PUBLIC_PER_MINUTE),
           "KVGATE_USAGE_RETENTION_DAYS": str(RETENTION_DAYS)}
    log = open(root / "gateway.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "kvgate", "gateway", "--port", str(port),
                             "--redis-url", server.url], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    gw = Gateway(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 60
    try:  # a gateway that never became ready leaves no process or Redis behind either
        with gw.client("127.0.0.250", key=None) as probe:  # an address no test uses
            while True:
                assert proc.poll() is None, (root / "gateway.log").read_text()
                assert time.monotonic() < deadline, "the gateway did not become ready"
                try:
                    if probe.get("/readyz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        yield gw
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        server.stop()
    assert "Traceback" not in (root / "gateway.log").read_text()


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# -- the throttle --------------------------------------------------------------------------------
def test_failed_authentication_is_a_burst_then_429_for_that_address_only(gateway):
    with gateway.client("127.0.0.2", key="sk-kvg-a-guess") as guesser, \
            gateway.client("127.0.0.2", key=None) as anonymous, \
            gateway.client("127.0.0.2") as admin_same_address, \
            gateway.client("127.0.0.3") as admin_elsewhere:
        statuses = [guesser.get("/admin/keys").status_code for _ in range(FAILURES_PER_MINUTE - 1)]
        statuses.append(anonymous.post("/v1/completions", json={}).status_code)  # no key counts too
        assert statuses == [401] * FAILURES_PER_MINUTE
        for client in (guesser, anonymous, admin_same_address):  # a right key cannot stand out
            resp = client.get("/v1/models")
            err = _error(resp, 429)
            assert err["type"] == "rate_limit_error" and err["code"] == "too_many_failed_auth"
            assert f"limit {FAILURES_PER_MINUTE} per minute" in err["message"]
            assert 1 <= int(resp.headers["retry-after"]) <= 60
        assert admin_elsewhere.get("/admin/keys").status_code == 200


def test_authenticated_traffic_spends_no_failure_budget(gateway):
    with gateway.client("127.0.0.4") as admin, \
            gateway.client("127.0.0.4", key="sk-kvg-wrong") as wrong:
        assert {admin.get("/admin/keys").status_code for _ in range(3 * FAILURES_PER_MINUTE)} == {200}
        assert [wrong.get("/admin/keys").status_code for _ in range(FAILURES_PER_MINUTE + 1)] == \
            [401] * FAILURES_PER_MINUTE + [429]


def test_public_routes_have_a_per_address_limit(gateway):
    with gateway.client("127.0.0.5", key=None) as scraper, \
            gateway.client("127.0.0.6", key=None) as other:
        routes = ["/healthz", "/readyz", "/metrics"]
        statuses = [scraper.get(routes[i % 3]).status_code for i in range(PUBLIC_PER_MINUTE)]
        assert statuses == [200] * PUBLIC_PER_MINUTE
        resp = scraper.get("/metrics")
        assert _error(resp, 429)["type"] == "rate_limit_error" and resp.headers["retry-after"]
        assert other.get("/metrics").status_code == 200


# -- admin bounds --------------------------------------------------------------------------------
SURROGATE = "\\ud800"  # as it appears in JSON text: a lone UTF-16 surrogate

BAD_KEY_FIELDS = [
    ("expires_in", 11 * 365 * 86400), ("expires_in", 2**70), ("expires_in", 0),
    ("rpm", 10**13), ("rpm", 2**64), ("tpm", -1), ("max_concurrent", 1e300),
    ("daily_tokens", 2**53 + 1), ("best_priority", -101), ("best_priority", 101),
    ("cache_scope", "everyone"), ("cache_isolation", True), ("name", "x" * 65),
    ("owner", "o" * 129), ("canary_cohort", "c" * 65), ("models", ["m"] * 257),
    ("models", ["m" * 257]), ("metadata", {f"k{i}": "v" for i in range(17)}),
    ("metadata", {"k" * 65: "v"}), ("metadata", {"k": "v" * 513}),
]


def _raw(client: httpx.Client, method: str, path: str, text: str) -> httpx.Response:
    return client.request(method, path, content=text.encode(),
                          headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("field,value", BAD_KEY_FIELDS)
def test_key_fields_out_of_range_are_422_naming_the_field(gateway, field, value):
    with gateway.client("127.0.0.7") as admin:
        body = {"name": "b-" + secrets.token_hex(4), field: value}
        err = _error(admin.post("/admin/keys", json=body), 422)
        assert err["param"].split(".")[0] == field and err["type"] == "invalid_request_error"
        if field == "name":
            return
        created = admin.post("/admin/keys", json={"name": "b-" + secrets.token_hex(4)}).json()
        err = _error(admin.patch(f"/admin/keys/{created['key']['id']}", json={field: value}), 422)
        assert err["param"].split(".")[0] == field


@pytest.mark.parametrize("text", [
    '{"name": "s-1", "owner": "a%sb"}', '{"name": "s-2", "metadata": {"k": "%s"}}',
    '{"name": "s-3", "metadata": {"%s": "v"}}', '{"name": "s-4", "models": ["%s"]}',
    '{"name": "s-5", "canary_cohort": "%s"}', '{"name": "%s"}'])
def test_lone_surrogates_in_key_bodies_are_422(gateway, text):
    with gateway.client("127.0.0.8") as admin:
        _error(_raw(admin, "POST", "/admin/keys", text % SURROGATE), 422)


def test_key_rotation_and_paths_are_bounded(gateway):
    with gateway.client("127.0.0.9") as admin:
        key = admin.post("/admin/keys", json={"name": "rot-" + secrets.token_hex(4)}).json()["key"]
        for grace in (-1, 31 * 86400, 2**64):
            err = _error(admin.post(f"/admin/keys/{key['id']}/rotate", json={"grace_s": grace}), 422)
            assert err["param"] == "grace_s"
        assert _error(admin.get("/admin/keys/" + "k" * 65), 422)["param"].endswith("key")
        assert _error(admin.get("/admin/keys/" + "k" * 64), 404)["code"] == "key_not_found"


def test_a_revoked_key_gets_no_new_secret(gateway):
    """Its new secret would be refused as revoked: a 409 that says so, and the record unchanged."""
    with gateway.client("127.0.0.13") as admin:
        key = admin.post("/admin/keys", json={"name": "rev-" + secrets.token_hex(4)}).json()["key"]
        assert admin.post(f"/admin/keys/{key['id']}/revoke").status_code == 200
        err = _error(admin.post(f"/admin/keys/{key['name']}/rotate", json={"grace_s": 0}), 409)
        assert err["code"] == "key_revoked" and "revoked" in err["message"], err
        record = admin.get(f"/admin/keys/{key['id']}").json()
        assert record["status"] == "revoked" and record.get("rotated") is None, record


def test_usage_since_is_bounded_and_clamped_to_retention(gateway):
    with gateway.client("127.0.0.10") as admin:
        assert _error(admin.get("/admin/usage", params={"since": "9" * 10_000}), 422)["param"].endswith("since")
        assert _error(admin.get("/admin/usage", params={"since": "9" * 11 + "w"}), 400)["param"] == "since"
        started = time.monotonic()
        resp = admin.get("/admin/usage", params={"since": "9" * 10 + "w", "by": "day"})
        assert resp.status_code == 200, resp.text
        assert time.monotonic() - started < 5  # three retained days read, not 10^10 weeks of them
        assert resp.json()["since"] >= time.time() - RETENTION_DAYS * 86400 - 60


BAD_CANARY_BODIES = [
    ({"weight": "NaN"}, "weight"), ({"weight": 101}, "weight"),
    ({"steps": [1 + i for i in range(21)], "interval_s": 60}, "steps"),
    ({"steps": [5, 50], "interval_s": 10**12}, "interval_s"),
    ({"thresholds": {"window_s": 10**9}}, "thresholds.window_s"),
    ({"thresholds": {"max_ttft_ratio": 1e308}}, "thresholds.max_ttft_ratio"),
    ({"thresholds": {"max_tpot_ratio": "Infinity"}}, "thresholds.max_tpot_ratio"),
    ({"thresholds": {"min_samples": 10**20}}, "thresholds.min_samples"),
    ({"thresholds": {"min_success_rate": "NaN"}}, "thresholds.min_success_rate"),
    ({"cohorts": {f"c{i}": "v1" for i in range(65)}}, "cohorts"),
    ({"cohorts": {"c" * 65: "v1"}}, "cohorts"), ({"version": "v" * 129}, "version"),
    ({"stable": "v" * 129}, "stable"),
]


@pytest.mark.parametrize("fields,param", BAD_CANARY_BODIES)
def test_canary_bodies_out_of_range_are_422(gateway, fields, param):
    body = json.dumps({"version": "v2", **fields}).replace('"NaN"', "NaN")
    body = body.replace('"Infinity"', "Infinity")  # json.loads takes both; JSON does not
    with gateway.client("127.0.0.11") as admin:
        err = _error(_raw(admin, "PUT", "/admin/canary/demo", body), 422)
        # NaN and Infinity may already be refused as JSON, before any field is looked at
        assert err["param"] is None and "JSON" in err["message"] or err["param"].startswith(param)


def test_canary_strings_and_paths_are_bounded(gateway):
    with gateway.client("127.0.0.12") as admin:
        _error(_raw(admin, "PUT", "/admin/canary/demo", '{"version": "v%s"}' % SURROGATE), 422)
        _error(_raw(admin, "PUT", "/admin/canary/demo",
                    '{"version": "v2", "cohorts": {"a": "%s"}}' % SURROGATE), 422)
        _error(_raw(admin, "POST", "/admin/canary/demo/rollback",
                    '{"reason": "%s"}' % SURROGATE), 422)
        _error(admin.post("/admin/canary/demo/rollback", json={"reason": "r" * 501}), 422)
        assert _error(admin.get("/admin/canary/" + "a" * 257), 422)["param"].endswith("alias")
        assert admin.get("/admin/keys").status_code == 200  # and the gateway still serves
