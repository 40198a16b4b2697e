"""The end-to-end path on a real Redis Cluster (3 primaries + 3 replicas): a gateway and a worker in
KVGATE_REDIS_MODE=cluster, Celery's broker on a Redis of its own, the official `openai` client."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from shared.redis_server import RedisClusterServers, RedisServer, free_port

pytestmark = pytest.mark.cluster
KEY = "sk-kvg-cluster-test-key"


@pytest.fixture
def stack(tmp_path: Path, tiny_model_dir: Path):
    servers = RedisClusterServers().start()
    broker = RedisServer().start()
    env = {**os.environ, "KVGATE_REDIS_MODE": "cluster", "KVGATE_REDIS_URL": servers.url,
           "KVGATE_BROKER_URL": broker.url, "KVGATE_HEARTBEAT_S": "0.3"}
    procs: list[subprocess.Popen] = []

    def spawn(name: str, *args: str, **extra: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "kvgate", *args], stdout=log,
                                stderr=subprocess.STDOUT, env={**env, **extra}, start_new_session=True)
        procs.append(proc)
        return proc

    port = free_port()
    spawn("worker", "worker", "--model", str(tiny_model_dir), "--served-name", "demo")
    gateway = spawn("gateway", "gateway", "--port", str(port), KVGATE_API_KEY=KEY,
                    KVGATE_SECRET="cluster-test-secret")
    url = f"http://127.0.0.1:{port}"
    _wait_for_model(url, gateway, tmp_path)
    try:
        yield url
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        broker.stop()
        servers.stop()


def _wait_for_model(url: str, gateway: subprocess.Popen, logs: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert gateway.poll() is None, (logs / "gateway.log").read_text()[-3000:]
        try:
            models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"},
                               timeout=2)
            if models.status_code == 200 and any(m["id"] == "demo" for m in models.json()["data"]):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the stack on the cluster did not list its model")


def test_chat_streamed_and_not_on_a_cluster(stack):
    client = openai.OpenAI(base_url=stack + "/v1", api_key=KEY, max_retries=0, timeout=60)
    ask = {"model": "demo", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
           "temperature": 0, "seed": 1}
    whole = client.chat.completions.create(**ask)
    assert whole.usage.completion_tokens == 8 and whole.choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(**ask, stream=True)
              if c.choices]
    assert "".join(pieces) == whole.choices[0].message.content  # greedy: the same text both ways
