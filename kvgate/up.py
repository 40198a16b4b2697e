"""`kvgate up`: the whole system on one machine as child processes (Redis, a worker, the gateway,
Celery worker and beat), for `make run` and tests."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from shared.redis_server import RedisServer, free_port

READY_TIMEOUT_S = 600


def default_model_dir() -> Path:
    """The demo model, built once into the user's cache folder."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvgate" / "demo-model-v1"
    if not (cache / "config.json").exists():
        from worker.models.demo import build_model_dir

        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        build_model_dir(tmp)
        tmp.replace(cache)
    return cache


def write_secret(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.chmod(path, 0o600)


class Stack:
    """Redis + worker + gateway; stops all of them on exit, whatever happened."""

    def __init__(self, state_dir: Path):
        self.state = state_dir
        self.redis: RedisServer | None = None
        self.children: list[tuple[str, subprocess.Popen]] = []

    def spawn(self, name: str, args: list[str], env: dict) -> None:
        log = open(self.state / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "kvgate", *args], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.children.append((name, proc))

    def dead_child(self) -> str | None:
        for name, proc in self.children:
            if proc.poll() is not None:
                return f"{name} exited with code {proc.returncode} (see {self.state / (name + '.log')})"
        return None

    def stop(self) -> None:
        for _, proc in reversed(self.children):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in reversed(self.children):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.redis:
            self.redis.stop()


def spawn_services(stack: Stack, env: dict) -> None:
    """Celery: a worker for the tasks and beat for the schedule. The worker's threads run batches
    (queue `batches`, at most KVGATE_BATCH_MAX_RUNNING at once) and leave two for the periodic
    tasks (queue `celery`), so a long batch never holds up a canary check."""
    from shared.batches import BATCH_QUEUE
    from shared.settings import ServicesSettings

    threads = ServicesSettings().batch_max_running + 2  # from the environment `env` copies
    stack.spawn("celery-worker", ["celery", "worker", "--pool", "threads", "--concurrency",
                                  str(threads), "--queues", f"celery,{BATCH_QUEUE}",
                                  "--loglevel", "INFO", "--without-gossip", "--without-mingle",
                                  "--without-heartbeat"], env)
    stack.spawn("celery-beat", ["celery", "beat", "--loglevel", "INFO",
                                "--schedule", str(stack.state / "celerybeat-schedule")], env)


def wait_ready(stack: Stack, url: str, key: str, served_name: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    headers = {"Authorization": f"Bearer {key}"}
    while time.monotonic() < deadline:
        if (why := stack.dead_child()) is not None:
            raise RuntimeError(why)
        try:
            models = httpx.get(f"{url}/v1/models", headers=headers, timeout=2)
            if models.status_code == 200 and any(m["id"] == served_name for m in models.json()["data"]):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"stack not ready after {READY_TIMEOUT_S}s")


def run_up(model, served_name, version_, engine, port, redis_port, state_dir,
           gateway_workers: int = 1) -> int:
    state = Path(state_dir).resolve()
    state.mkdir(parents=True, exist_ok=True)
    model_dir = Path(model).resolve() if model else default_model_dir()
    port = port or free_port()
    stack = Stack(state)
    stopping = False

    def on_signal(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        stack.redis = RedisServer(port=redis_port, data_dir=state / "redis").start()
        key = "sk-kvg-dev-" + secrets.token_urlsafe(24)
        admin_key = "sk-kvg-admin-" + secrets.token_urlsafe(24)
        env = {**os.environ, "KVGATE_REDIS_URL": stack.redis.url,
               "KVGATE_DATA_DIR": os.environ.get("KVGATE_DATA_DIR", str(state / "data"))}
        # The worker shares this machine: OpenMP threads on every core, spinning while the
        # gateway and Redis want a core, cost ~20% of tokens/s at 64 streams on 2 cores.
        threads = os.environ.get("KVGATE_TORCH_THREADS") or str(max(1, (os.cpu_count() or 2) // 2))
        stack.spawn("worker", ["worker", "--model", str(model_dir), "--served-name", served_name,
                               "--version", version_, "--engine", engine,
                               "--redis-url", stack.redis.url], {**env, "KVGATE_TORCH_THREADS": threads})
        stack.spawn("gateway", ["gateway", "--port", str(port), "--redis-url", stack.redis.url,
                                "--workers", str(gateway_workers)],
                    {**env, "KVGATE_API_KEY": key, "KVGATE_ADMIN_KEY": admin_key,
                     "KVGATE_SECRET": server_secret(state)})
        url = f"http://127.0.0.1:{port}"
        spawn_services(stack, {**env, "KVGATE_GATEWAY_URL": url, "KVGATE_SECRET": server_secret(state)})
        wait_ready(stack, url, key, served_name)
        metrics_url = worker_metrics_url(stack.redis.url, served_name)
        (state / "worker.metrics.url").write_text(metrics_url + "\n")
        _write_state(state, url, stack.redis.url, key, admin_key, model_dir)
        _announce(url, key, served_name, state)
        while not stopping:
            if (why := stack.dead_child()) is not None:
                print(f"kvgate up: {why}; stopping", file=sys.stderr)
                return 1
            time.sleep(0.3)
        return 0
    except RuntimeError as exc:
        print(f"kvgate up: {exc}", file=sys.stderr)
        return 1
    finally:
        print("kvgate up: stopping", file=sys.stderr)
        stack.stop()


def worker_metrics_url(redis_url: str, served_name: str) -> str:
    """The /metrics URL the live worker of `served_name` put in its registry entry."""
    import orjson
    import redis

    from shared import names

    client = redis.Redis.from_url(redis_url)
    try:
        for worker_id in client.zrange(names.WORKERS_ZSET, 0, -1):
            raw = client.get(names.worker_key(worker_id.decode()))
            info = orjson.loads(raw) if raw else {}
            if info.get("served_name") == served_name and info.get("metrics_url"):
                return info["metrics_url"]
    finally:
        client.close()
    raise RuntimeError("the worker did not say where its metrics are")


def server_secret(state: Path) -> str:
    """KVGATE_SECRET if set; else one generated once and kept in the state folder, so the keys in
    Redis (which lives there too) stay valid across restarts."""
    if os.environ.get("KVGATE_SECRET"):
        return os.environ["KVGATE_SECRET"]
    path = state / "server.secret"
    if not path.exists():
        write_secret(path, secrets.token_urlsafe(32))
    return path.read_text().strip()


def _write_state(state: Path, url: str, redis_url: str, key: str, admin_key: str,
                 model_dir: Path) -> None:
    (state / "gateway.url").write_text(url + "\n")
    (state / "redis.url").write_text(redis_url + "\n")
    (state / "model.dir").write_text(str(model_dir) + "\n")
    write_secret(state / "admin.key", admin_key)
    write_secret(state / "dev.key", key)  # last: scripts wait for it


def _announce(url: str, key: str, served_name: str, state: Path) -> None:
    print(f"kvgate is up at {url}  (model '{served_name}')")
    print(f"dev key: {key}")
    print(f"admin key: in {state / 'admin.key'} (for `kvgate keys ...` and /admin)")
    worker_metrics = (state / "worker.metrics.url").read_text().strip()
    print(f"metrics: {url}/metrics (gateway), {worker_metrics} (worker)")
    print("try:")
    print(f"  curl -N {url}/v1/chat/completions -H 'Authorization: Bearer {key}' "
          f"-H 'Content-Type: application/json' -d '{{\"model\": \"{served_name}\", \"stream\": true, "
          f"\"max_tokens\": 32, \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'",
          flush=True)
