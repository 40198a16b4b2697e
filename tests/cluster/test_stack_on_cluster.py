"""`kvgate up --redis-url` on a real Redis Cluster (KVGATE_REDIS_MODE=cluster; Celery on a Redis of
its own): a batch end to end through the official `openai` client (upload, create, the Celery
runner completes it, download, delete), and a canary split and rollback over a second version's
worker, with the canary's series on /metrics read back from the tagged names."""
from __future__ import annotations

import io
import os
import secrets
import signal
import subprocess
import sys
import time

import httpx
import openai
import orjson
import pytest

from shared import canary
from tests.conftest import Stack, start_stack, stop_stack

pytestmark = pytest.mark.cluster
LIVE_V2 = 'kvgate_workers_live{model="demo",version="v2"} 1.0'  # read from the tagged names
CLUSTER_ENV = {"KVGATE_REDIS_MODE": "cluster", "KVGATE_MAINTENANCE_S": "2",
               "KVGATE_CANARY_CHECK_S": "1"}


@pytest.fixture(scope="module")
def stack(redis_cluster, tiny_model_dir, tmp_path_factory):
    state = tmp_path_factory.mktemp("stack-on-cluster") / ".kvgate"
    s = start_stack(tiny_model_dir, state, "paged", CLUSTER_ENV, args=["--redis-url", redis_cluster.url])
    yield s
    stop_stack(s.proc)
    assert s.proc.returncode == 0, f"kvgate up exited with {s.proc.returncode}"


def _admin(stack: Stack, method: str, path: str, **kwargs) -> httpx.Response:
    admin = (stack.state / "admin.key").read_text().strip()
    return httpx.request(method, stack.url + path, headers={"Authorization": f"Bearer {admin}"},
                         timeout=30, **kwargs)


def _key(stack: Stack) -> tuple[str, str]:
    resp = _admin(stack, "POST", "/admin/keys", json={"name": "c-" + secrets.token_hex(4)})
    assert resp.status_code == 201, resp.text
    return resp.json()["key"]["id"], resp.json()["secret"]


def test_a_batch_runs_end_to_end_on_a_cluster(stack):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.key, max_retries=0)
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "demo", "max_tokens": 2,
                       "messages": [{"role": "user", "content": f"say {i}"}]}} for i in range(5)]
    upload = client.files.create(file=("in.jsonl", io.BytesIO(b"".join(orjson.dumps(ln) + b"\n"
                                                                       for ln in lines))),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    deadline = time.monotonic() + 90
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed",
                                                                        "expired", "cancelled"):
        assert time.monotonic() < deadline, f"batch stuck: {batch}"
        time.sleep(0.3)
    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {"total": 5, "completed": 5, "failed": 0}
    assert batch.usage.output_tokens == 10 and batch.error_file_id is None
    out = [orjson.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == [f"line-{i}" for i in range(5)]
    assert {o["response"]["status_code"] for o in out} == {200}
    assert batch.id in [b.id for b in client.batches.list()]
    assert {upload.id, batch.output_file_id} <= {f.id for f in client.files.list()}

    assert client.files.delete(upload.id).deleted  # the owner's list, record and expiry index
    assert upload.id not in {f.id for f in client.files.list()}
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)


def _served(stack: Stack, secret: str) -> str:
    resp = httpx.post(stack.url + "/v1/completions", timeout=60, headers={
        "Authorization": f"Bearer {secret}"}, json={"model": "demo", "prompt": "Hello",
                                                    "max_tokens": 2, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return resp.headers["x-kvgate-version"]


@pytest.fixture(scope="module")
def second_version(stack, redis_cluster, tiny_model_dir):
    log = open(stack.state / "worker-v2.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "kvgate", "worker", "--model", str(tiny_model_dir),
                             "--served-name", "demo", "--version", "v2", "--engine", "paged"],
                            env={**os.environ, **CLUSTER_ENV, "KVGATE_REDIS_URL": redis_cluster.url},
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while LIVE_V2 not in httpx.get(stack.url + "/metrics", timeout=30).text:
        assert proc.poll() is None, (stack.state / "worker-v2.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "worker v2 did not come up"
        time.sleep(0.3)
    yield proc
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


def test_canary_split_and_rollback_on_a_cluster(stack, second_version):
    set_ = _admin(stack, "PUT", "/admin/canary/demo", json={"version": "v2", "weight": 50})
    assert set_.status_code == 200, set_.text
    keys = [_key(stack) for _ in range(8)]
    expected = {kid: "v2" if canary.bucket(kid, "demo") < 5000 else "v1" for kid, _ in keys}
    assert [_served(stack, s) for _, s in keys] == [expected[k] for k, _ in keys]
    assert [_served(stack, s) for _, s in keys] == [expected[k] for k, _ in keys]  # sticky
    metrics = httpx.get(stack.url + "/metrics", timeout=30).text
    assert 'kvgate_canary_weight_percent{model="demo",phase="canary",version="v2"} 50.0' in metrics
    assert 'kvgate_stream_depth{lane="interactive",model="demo",version="v2"}' in metrics

    back = _admin(stack, "POST", "/admin/canary/demo/rollback", json={"reason": "test"})
    assert back.status_code == 200 and back.json()["phase"] == "rolled_back", back.text
    deadline = time.monotonic() + 5  # every gateway process's cached route
    while {_served(stack, s) for _, s in keys} != {"v1"}:
        assert time.monotonic() < deadline, "traffic still reaches v2 after the rollback"
    status = _admin(stack, "GET", "/admin/canary/demo").json()
    assert [e["kind"] for e in status["events"]][:2] == ["rollback", "set"]
    metrics = httpx.get(stack.url + "/metrics", timeout=30).text
    assert 'kvgate_canary_rollbacks_total{model="demo",trigger="manual"} 1.0' in metrics
