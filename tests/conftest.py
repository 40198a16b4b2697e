"""Fixtures that start real things: a redis-server, tiny model folders, the whole stack via `kvgate up`."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

# Triton reads this when a kernel is defined: without a GPU, its kernels run in the interpreter.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)

# The longest modules (1.5 to 3.5 minutes each here), run first: `make test` spreads modules over two
# processes (pytest-xdist, --dist loadfile), each module whole on one, in this order; one of these
# started last kept the other process idle for minutes. The rest keep their order.
LONGEST_FIRST = ("integration/test_faults.py", "integration/test_hostile.py", "worker/kernels/test_gpu_check_smoke.py",
                 "integration/test_resume.py", "integration/test_agents.py", "integration/test_fairness.py",
                 "integration/test_canary.py", "worker/engine/test_model_families.py", "kvgate/test_bench_programs.py",
                 "worker/engine/test_tensor_parallel.py", "kvgate/test_drills.py")


def pytest_collection_modifyitems(config, items):
    rank = {f"tests/{path}": i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))  # stable: modules stay whole


@pytest.fixture(scope="session")
def redis_server():
    from shared.redis_server import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture
async def aredis(redis_server):
    """An asyncio client on the session's Redis, emptied first."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_server.url)
    await client.flushall()
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from worker.models.demo import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("tiny-llama"), **TINY)


@pytest.fixture(scope="session")
def qwen3_06b_dir(tmp_path_factory) -> Path:
    """A random-weight folder in Qwen3-0.6B's exact shape (bf16 shards, vocab 151,936, 40,960
    context; ~1.2 GB, built in ~20 s), named like the real one."""
    from worker.models.shaped import build_qwen3_06b_dir

    return build_qwen3_06b_dir(tmp_path_factory.mktemp("qwen3") / "Qwen3-0.6B")


@dataclass
class Stack:
    url: str
    key: str
    redis_url: str
    state: Path
    proc: subprocess.Popen

    def worker_info(self) -> dict:
        import orjson
        import redis

        from shared import names

        client = redis.Redis.from_url(self.redis_url)
        ids = client.zrange(names.WORKERS_ZSET, 0, -1)
        infos = [client.get(names.worker_key(i.decode())) for i in ids]
        client.close()
        live = [orjson.loads(i) for i in infos if i]
        assert len(live) == 1, f"expected one live worker, found {len(live)}"
        return live[0]


def start_stack(model_dir: Path, state: Path, engine: str, extra_env: dict | None = None,
                args: list[str] | None = None, served_name: str | None = "demo") -> Stack:
    """`kvgate up` on `model_dir`, served as `served_name` (None: the folder's own name)."""
    env = {**os.environ, **(extra_env or {})}
    named = ["--served-name", served_name] if served_name else []
    cmd = [sys.executable, "-m", "kvgate", "up", "--model", str(model_dir), "--port", "0",
           "--state-dir", str(state), "--engine", engine, *named, *(args or [])]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    while not (state / "dev.key").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            out = proc.stdout.read().decode(errors="replace") if proc.poll() is not None else ""
            logs = "".join(p.read_text(errors="replace")[-3000:] for p in state.glob("*.log"))
            stop_stack(proc)
            raise RuntimeError(f"kvgate up did not become ready:\n{out}\n{logs}")
        time.sleep(0.2)
    return Stack(url=(state / "gateway.url").read_text().strip(), key=(state / "dev.key").read_text().strip(),
                 redis_url=(state / "redis.url").read_text().strip(), state=state, proc=proc)


def stop_stack(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module", params=["paged", "hf"])
def stack(request, tiny_model_dir, tmp_path_factory):
    s = start_stack(tiny_model_dir, tmp_path_factory.mktemp(f"stack-{request.param}"), request.param)
    s.engine = request.param
    yield s
    stop_stack(s.proc)
    assert s.proc.returncode == 0, f"kvgate up exited with {s.proc.returncode}"


@contextmanager
def worker_thread(redis_url: str, model_dir: Path, served_name: str, **settings):
    """A worker (the synthetic engine unless `settings` say otherwise) serving in a thread of this
    process, for tests that run the gateway in-process too."""
    import threading

    from shared.settings import WorkerSettings
    from worker.main import build_engine
    from worker.service import WorkerService

    ws = WorkerSettings(model=str(model_dir), redis_url=redis_url, served_name=served_name,
                        **{"engine": "synthetic", "heartbeat_s": 0.2, **settings})
    engine = build_engine(ws)
    service = WorkerService(ws, engine, engine.tokenizer)
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    try:
        yield service
    finally:
        service.stop()
        thread.join(10)


async def until_listed(client, key: str) -> None:
    """Until the gateway behind `client` lists a model (its worker's first heartbeat landed)."""
    import asyncio

    for _ in range(100):
        models = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        if models.json()["data"]:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("no model listed within 10 s")


def wire_entry(request_id: str, channel: str, max_tokens: int = 8, **fields):
    """A request entry as a gateway would XADD it (greedy, ignore_eos), for tests that play the
    gateway at the protocol level; `params` overrides sampling fields."""
    from shared import protocol

    now = time.time()
    params = protocol.WireParams(**{"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                                    **fields.pop("params", {})})
    return protocol.RequestEntry(request_id=request_id, reply_channel=channel, model="demo",
                                 version="v1", kind="completion", created=now, deadline=now + 60,
                                 params=params, **fields)


@pytest.fixture(scope="module")
def baseline(tiny_model_dir):
    """The bare baseline server of the serving benchmarks (kvgate/bench/baseline.py) on the tiny
    model, behind the key `sk-base`: its URL."""
    import httpx

    from shared.redis_server import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvgate.bench.baseline", "--model", str(tiny_model_dir),
                             "--port", str(port)], env={**os.environ, "KVGATE_BASELINE_API_KEY": "sk-base"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            httpx.get(url + "/healthz", timeout=1)
            break
        except httpx.HTTPError:
            assert proc.poll() is None and time.monotonic() < deadline, "the baseline did not start"
            time.sleep(0.2)
    yield url
    stop_stack(proc)
