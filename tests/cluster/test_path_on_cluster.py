"""The end-to-end path on a real Redis Cluster (3 primaries + 3 replicas): two gateways and a worker
in KVGATE_REDIS_MODE=cluster, Celery's broker on a Redis of its own, a key made through /admin (so
key creation, lookup, reservation, settlement and usage all run on the cluster), the official
`openai` client, the exact rate limit across both gateways, and a worker SIGKILLed mid-stream whose
requests resume, identical, on another."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from redis.cluster import RedisCluster

from shared import names
from shared.redis_server import RedisClusterServers, RedisServer, free_port
from tests.integration.test_faults import fresh_entry

pytestmark = pytest.mark.cluster
ADMIN = "sk-kvg-cluster-admin-key"


@dataclass
class ClusterStack:
    gateways: list[str]
    logs: Path
    model_dir: Path
    spawn: Callable[..., subprocess.Popen]
    client: RedisCluster

    def start_worker(self, name: str, served: str, *flags: str, **env: str) -> subprocess.Popen:
        proc = self.spawn(name, "worker", "--model", str(self.model_dir), "--served-name", served,
                          *flags, KVGATE_WORKER_ID=name, KVGATE_HEARTBEAT_TTL_S="2", **env)
        deadline = time.monotonic() + 90
        while self.info(name) is None:
            assert proc.poll() is None and time.monotonic() < deadline, \
                (self.logs / f"{name}.log").read_text()[-3000:]
            time.sleep(0.1)
        return proc

    def info(self, worker_id: str) -> dict | None:
        raw = self.client.get(names.worker_key(worker_id))
        return orjson.loads(raw) if raw else None

    def fresh_info(self, worker_id: str, timeout: float = 10) -> dict:
        return fresh_entry(self.info, worker_id, timeout)

    def create_key(self, name: str, **fields) -> str:
        resp = httpx.post(self.gateways[0] + "/admin/keys", json={"name": name, **fields}, timeout=30,
                          headers={"Authorization": f"Bearer {ADMIN}"})
        assert resp.status_code == 201, resp.text
        return resp.json()["secret"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir: Path):
    logs = tmp_path_factory.mktemp("cluster")
    servers = RedisClusterServers().start()
    broker = RedisServer().start()
    env = {**os.environ, "KVGATE_REDIS_MODE": "cluster", "KVGATE_REDIS_URL": servers.url,
           "KVGATE_BROKER_URL": broker.url, "KVGATE_HEARTBEAT_S": "0.3", "KVGATE_ADMIN_KEY": ADMIN,
           "KVGATE_SECRET": "cluster-test-secret", "KVGATE_ADMISSION_WAIT_S": "0"}
    procs: list[subprocess.Popen] = []

    def spawn(name: str, *args: str, **extra: str) -> subprocess.Popen:
        log = open(logs / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "kvgate", *args], stdout=log,
                                stderr=subprocess.STDOUT, env={**env, **extra}, start_new_session=True)
        procs.append(proc)
        return proc

    spawn("worker", "worker", "--model", str(tiny_model_dir), "--served-name", "demo")
    urls = []
    for i in range(2):
        port = free_port()
        # killed at the end, so each keeps its metrics folder here rather than one of its own in /tmp
        gateway = spawn(f"gateway{i}", "gateway", "--port", str(port),
                        PROMETHEUS_MULTIPROC_DIR=str(logs / f"metrics-gateway{i}"))
        urls.append(f"http://127.0.0.1:{port}")
        _wait_for_model(urls[-1], gateway, logs / f"gateway{i}.log")
    client = RedisCluster.from_url(servers.url)
    try:
        yield ClusterStack(gateways=urls, logs=logs, model_dir=tiny_model_dir, spawn=spawn, client=client)
    finally:
        client.close()
        for proc in procs:
            proc.kill()
            proc.wait()
        broker.stop()
        servers.stop()


def _wait_for_model(url: str, gateway: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert gateway.poll() is None, log.read_text()[-3000:]
        try:
            models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {ADMIN}"},
                               timeout=2)
            if models.status_code == 200 and any(m["id"] == "demo" for m in models.json()["data"]):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the stack on the cluster did not list its model")


def test_chat_streamed_and_not_on_a_cluster(stack):
    secret = stack.create_key("path")
    client = openai.OpenAI(base_url=stack.gateways[0] + "/v1", api_key=secret, max_retries=0, timeout=60)
    ask = {"model": "demo", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
           "temperature": 0, "seed": 1}
    whole = client.chat.completions.create(**ask)
    assert whole.usage.completion_tokens == 8 and whole.choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(**ask, stream=True)
              if c.choices]
    assert "".join(pieces) == whole.choices[0].message.content  # greedy: the same text both ways
    assert _usage(stack, "path") == {"requests": 2, "completion_tokens": 16}  # read by the other gateway


def _usage(stack: ClusterStack, key: str, timeout: float = 10) -> dict:
    """A key's usage once both requests are settled (the stream's is recorded as its reply ends)."""
    deadline = time.monotonic() + timeout
    while True:
        resp = httpx.get(stack.gateways[1] + "/admin/usage", params={"key": key, "by": "key"},
                         timeout=30, headers={"Authorization": f"Bearer {ADMIN}"})
        assert resp.status_code == 200, resp.text
        rows = resp.json()["rows"]
        got = {k: rows[0][k] for k in ("requests", "completion_tokens")} if rows else {}
        if got.get("requests") == 2 or time.monotonic() > deadline:
            return got
        time.sleep(0.2)

def test_rpm_admits_exactly_the_limit_over_two_gateways_on_a_cluster(stack):
    secret = stack.create_key("rpm", rpm=50)
    body = {"model": "demo", "prompt": "Hello world", "max_tokens": 1, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {secret}"}

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=220)) as client:
            return await asyncio.gather(*(client.post(stack.gateways[i % 2] + "/v1/completions",
                                                      json=body, headers=headers) for i in range(200)))

    responses = asyncio.run(fire())
    assert Counter(r.status_code for r in responses) == {200: 50, 429: 150}, [
        r.text for r in responses if r.status_code not in (200, 429)][:3]
    assert all("requests per minute" in r.json()["error"]["message"]
               for r in responses if r.status_code == 429)


def test_worker_killed_mid_stream_its_requests_resume_on_the_other_on_a_cluster(stack):
    """Its own served name, so the stack's worker takes none of these requests; five slots each,
    so each worker takes five of the ten."""
    secret = stack.create_key("takeover")
    # FIFO on both: each reads only its room (five). Under the fair order a worker reads ahead up
    # to KVGATE_FAIR_LOOKAHEAD entries, so whichever read first could hold all ten, and the victim
    # would not have five running when it is killed (nothing lost: the other resumes them)
    fifo = {"KVGATE_FAIR_ORDER": "false"}
    victim = stack.start_worker("w-victim", "takeover", "--max-num-seqs", "5", **fifo)
    stack.start_worker("w-survivor", "takeover", "--max-num-seqs", "5", **fifo)
    n, chunks = 10, [0]
    body = {"model": "takeover", "prompt": "Request says", "max_tokens": 80, "temperature": 0,
            "ignore_eos": True, "stream": True}

    async def stream(client: httpx.AsyncClient, i: int, count: bool) -> str:
        text = ""
        async with client.stream("POST", stack.gateways[i % 2] + "/v1/completions",
                                 json={**body, "prompt": f"Request {i} says"},
                                 headers={"Authorization": f"Bearer {secret}"}) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    event = orjson.loads(line[6:])
                    assert "error" not in event, event
                    text += event["choices"][0]["text"]
                    chunks[0] += count
        return text

    async def scenario() -> tuple[list[str], list[str]]:
        async with httpx.AsyncClient(timeout=180, limits=httpx.Limits(max_connections=20)) as client:
            tasks = [asyncio.create_task(stream(client, i, True)) for i in range(n)]
            while not (chunks[0] >= 2 * 5 * 3 and stack.info("w-victim")["active"] == 5):
                assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
                await asyncio.sleep(0.01)  # until the victim's five are mid-stream
            victim.send_signal(signal.SIGKILL)
            results = await asyncio.gather(*tasks)
            reference = await asyncio.gather(*(stream(client, i, False) for i in range(n)))
            return results, reference

    results, reference = asyncio.run(scenario())
    assert stack.fresh_info("w-survivor")["requests_resumed"] == 5
    assert results == reference  # resumed text equals an uninterrupted run
    assert all(results)
