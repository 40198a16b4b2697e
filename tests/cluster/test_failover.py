"""A Redis primary fails under load: 20 streamed requests in flight through a gateway and a worker,
then on a Redis Cluster the primary that holds the model's request streams is SIGKILLed and its
replica promoted (node timeout 1 s, no CLUSTER FAILOVER); on Sentinel (one primary, one replica,
three sentinels, after an end-to-end check with the `openai` client) the primary is SIGKILLed and
the sentinels promote the replica. No kvgate process exits, every request in flight finishes or
ends with a clear error within a bound, new requests succeed within a few seconds, and no key is
charged twice: each request has its own key, so its usage is its own."""
from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time

from pathlib import Path

import httpx
import openai
import orjson
import pytest
import redis
from redis.cluster import RedisCluster

from shared import names
from shared.redis_server import RedisClusterServers, RedisSentinelServers, RedisServer, free_port
from tests.cluster.test_path_on_cluster import ADMIN, _wait_for_model

pytestmark = pytest.mark.cluster
N, MAX_TOKENS = 20, 40
BOUND_S = 60  # a request in flight ends by then, one way or the other
PROMOTION_BOUND_S = 75  # Redis's own failover (a starved sentinel's TILT mode lasts 30 s)


@contextlib.contextmanager
def _stack(tmp_path: Path, model_dir: Path, redis_env: dict):
    """A worker and a gateway on the Redis `redis_env` names (Celery's broker on one of its own)."""
    broker = RedisServer().start()
    env = {**os.environ, **redis_env, "KVGATE_BROKER_URL": broker.url, "KVGATE_HEARTBEAT_S": "0.3",
           "KVGATE_ADMIN_KEY": ADMIN, "KVGATE_SECRET": "failover-secret", "KVGATE_ADMISSION_WAIT_S": "0",
           "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics")}  # the gateway is killed: not one in /tmp
    procs = {}
    for name, args in (("worker", ["worker", "--model", str(model_dir), "--served-name", "demo"]),
                       ("gateway", ["gateway", "--port", str(port := free_port())])):
        log = open(tmp_path / f"{name}.log", "ab")
        procs[name] = subprocess.Popen([sys.executable, "-m", "kvgate", *args], stdout=log,
                                       stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_model(url, procs["gateway"], tmp_path / "gateway.log")
        yield url, procs
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
        broker.stop()


def _stream_primary(servers: RedisClusterServers) -> RedisServer:
    """The primary that holds the slot of the model's request streams ({m:demo})."""
    client = RedisCluster.from_url(servers.url)
    try:
        node = client.get_node_from_key(names.request_stream("demo", "v1"))
        return next(n for n in servers.nodes if n.port == node.port)
    finally:
        client.close()


async def _stream(client: httpx.AsyncClient, url: str, secret: str, i: int, seen: list[int]) -> dict:
    out = {"status": None, "tokens": 0, "finish": None, "error": None}
    body = {"model": "demo", "prompt": f"Request {i} says", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {secret}"}) as resp:
        out["status"] = resp.status_code
        if resp.status_code != 200:
            out["error"] = orjson.loads(await resp.aread())["error"]
            return out
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = orjson.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]
            elif event.get("usage"):
                out["tokens"] = event["usage"]["completion_tokens"]
            elif event["choices"]:
                out["finish"] = event["choices"][0]["finish_reason"] or out["finish"]
                seen[0] += 1
    return out


def _admin(url: str, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, url + path, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30, **kw)


def test_a_cluster_primary_killed_under_load_fails_over_cleanly(tmp_path, tiny_model_dir):
    with RedisClusterServers(node_timeout_ms=1000) as servers, _stack(tmp_path, tiny_model_dir, {
            "KVGATE_REDIS_MODE": "cluster", "KVGATE_REDIS_URL": servers.url}) as (url, procs):
        victim = _stream_primary(servers)
        survivor = next(n for n in servers.nodes if n is not victim)
        _fail_under_load(url, procs, tmp_path, victim.proc.kill,
                         lambda: _promoted_past(survivor, victim.port))


def test_a_sentinel_primary_killed_under_load_fails_over_cleanly(tmp_path, tiny_model_dir):
    with RedisSentinelServers(down_after_ms=1000) as servers, _stack(tmp_path, tiny_model_dir, {
            "KVGATE_REDIS_MODE": "sentinel", "KVGATE_REDIS_URL": servers.url,
            "KVGATE_REDIS_SENTINEL_SERVICE": servers.service}) as (url, procs):
        secret = _admin(url, "POST", "/admin/keys", json={"name": "path"}).json()["secret"]
        client = openai.OpenAI(base_url=url + "/v1", api_key=secret, max_retries=0, timeout=60)
        ask = {"model": "demo", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
               "temperature": 0, "seed": 1}
        whole = client.chat.completions.create(**ask)
        pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            **ask, stream=True) if c.choices]
        assert whole.usage.completion_tokens == 8 and "".join(pieces) == whole.choices[0].message.content
        old = servers.primary.port
        _fail_under_load(url, procs, tmp_path, servers.primary.proc.kill,
                         lambda: servers.primary_port() != old)
        assert servers.primary_port() == servers.replicas[0].port  # the replica was promoted


def _promoted_past(node: RedisServer, dead_port: int) -> bool:
    """`node` sees the dead primary failed and serves every slot again (its replica took over)."""
    client = redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=1, decode_responses=True)
    try:
        lines = client.execute_command("CLUSTER", "NODES").splitlines()
        dead = next(line.split() for line in lines if f":{dead_port}@" in line)
        return "fail" in dead[2].split(",") and \
            client.execute_command("CLUSTER", "INFO").count("cluster_state:ok") == 1
    except (redis.RedisError, StopIteration):
        return False
    finally:
        client.close()


def _fail_under_load(url: str, procs: dict, logs: Path, kill, promoted) -> None:
    """N streamed requests, one key each; `kill` the primary once every one is under way. Redis's
    own failover (`promoted`) is timed apart from kvgate's recovery after it: on a loaded machine a
    sentinel can lose seconds (or go into TILT for 30 s when its timer is starved), and that is
    Redis's time, not kvgate's."""
    keys = []
    for i in range(N):
        resp = _admin(url, "POST", "/admin/keys", json={"name": f"fo-{i}"})
        assert resp.status_code == 201, resp.text
        keys.append(resp.json()["secret"])
    seen = [0]

    async def scenario():
        async with httpx.AsyncClient(timeout=BOUND_S, limits=httpx.Limits(max_connections=N + 4)) as c:
            tasks = [asyncio.create_task(_stream(c, url, keys[i], i, seen)) for i in range(N)]
            while seen[0] < N:  # every request under way
                assert not all(t.done() for t in tasks), [t.result() for t in tasks]
                await asyncio.sleep(0.01)
            kill()
            killed = time.monotonic()
            probe = asyncio.get_running_loop().run_in_executor(None, _first_success, url, keys[0],
                                                               killed, promoted)
            done, pending = await asyncio.wait(tasks, timeout=BOUND_S)
            assert not pending, f"{len(pending)} requests still open {BOUND_S}s after the kill"
            return [t.result() for t in tasks], time.monotonic() - killed, await probe

    results, ended, (promoted_s, recovered) = asyncio.run(scenario())
    print(f"\n[failover] {sum(r['finish'] == 'length' for r in results)}/{N} in flight finished, "
          f"the last {ended:.1f}s after the kill; Redis promoted a replica {promoted_s:.1f}s after "
          f"it, and a new request succeeded {recovered:.1f}s after the kill")
    assert recovered - promoted_s < 15
    for name, proc in procs.items():
        assert proc.poll() is None, f"{name} exited: " + (logs / f"{name}.log").read_text()[-3000:]
    for r in results:  # finished whole, or a clear error (503 before the stream, an error event in it)
        assert (r["finish"] == "length" and r["tokens"] == MAX_TOKENS and r["error"] is None) or \
            (r["error"] is not None and set(r["error"]) >= {"message", "type", "code"}), r
    _assert_charged_once(url, results)


def _first_success(url: str, secret: str, since: float, promoted) -> tuple[float, float]:
    """Seconds from the kill to Redis's promotion, and to kvgate's first success: until then,
    every answer is a 503 with Retry-After."""
    body = {"model": "demo", "prompt": "after", "max_tokens": 2, "ignore_eos": True}
    promoted_s = None
    while True:
        if promoted_s is None and promoted():
            promoted_s = time.monotonic() - since
        resp = httpx.post(url + "/v1/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {secret}"})
        if resp.status_code == 200:
            return (time.monotonic() - since if promoted_s is None else promoted_s,
                    time.monotonic() - since)
        assert resp.status_code == 503 and resp.headers.get("retry-after"), resp.text
        assert time.monotonic() - since < PROMOTION_BOUND_S, f"Redis promoted no replica: {resp.text}"
        assert promoted_s is None or time.monotonic() - since - promoted_s < 15, resp.text
        time.sleep(0.2)


def _assert_charged_once(url: str, results: list[dict]) -> None:
    """Per key (one request each, plus key 0's probes after recovery): a request that finished is
    charged exactly its tokens once; one that failed at most what it reserved (max_tokens)."""
    deadline = time.monotonic() + 10
    for i, r in enumerate(results):
        while True:
            rows = _admin(url, "GET", "/admin/usage", params={"key": f"fo-{i}", "by": "key"}).json()["rows"]
            got = rows[0] if rows else {"requests": 0, "completion_tokens": 0}
            probes = got["requests"] - 1 if i == 0 else 0  # key 0 also sent the recovery probes
            if r["finish"] == "length" and got["completion_tokens"] - 2 * probes == MAX_TOKENS \
                    or r["finish"] != "length" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        charged = got["completion_tokens"] - 2 * probes
        if r["finish"] == "length":
            assert got["requests"] - probes == 1 and charged == MAX_TOKENS, (i, r, got)
        else:
            assert got["requests"] - probes <= 1 and charged <= MAX_TOKENS, (i, r, got)
