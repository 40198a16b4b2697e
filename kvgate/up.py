"""`kvgate up`: the whole system on one machine as child processes (Redis, a worker, the gateway,
Celery worker and beat), for `make run` and tests.

Supervised: once the stack has been ready, a child that dies is started again after a back-off
(1 s doubling to 30 s, back to 1 s for a child that had run a minute), each restart said on stderr
and in the child's log; only Ctrl-C or SIGTERM stops the stack. Before it was ever ready, a child
that dies ends `kvgate up` with its log's last lines: a broken model folder fails at once, loudly,
instead of restarting forever.
"""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from kvgate.tls import DevCerts, dev_certs, trust_hint
from shared.backoff import Backoff
from shared.logs import JsonFormatter
from shared.redis_server import RedisServer, free_port
from shared.settings import served_name_for

READY_TIMEOUT_S = 600
RESTART_FIRST_S, RESTART_CAP_S = 1.0, 30.0
STEADY_S = 60.0  # a child that ran this long before it died restarts after RESTART_FIRST_S again
LOG_TAIL_LINES = 20


def default_model_dir() -> Path:
    """The demo model, built once into the user's cache folder."""
    # v2: its template renders tools and thinking; a new name, so a cached v1 is not served instead
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvgate" / "demo-model-v2"
    if not (cache / "config.json").exists():
        from worker.models.demo import build_model_dir

        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        build_model_dir(tmp)
        try:
            tmp.replace(cache)
        except OSError:  # another process built it first (a directory is not replaced once full)
            if not (cache / "config.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    return cache


def write_secret(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.chmod(path, 0o600)


class Child:
    """One supervised process: how to start it, where it logs, when it may start again."""

    def __init__(self, name: str, launch: Callable[[], subprocess.Popen], log: Path | None,
                 pid_file: Path):
        self.name, self.launch, self.log, self.pid_file = name, launch, log, pid_file
        self.backoff = Backoff(RESTART_FIRST_S, RESTART_CAP_S)
        self.restart_at: float | None = None  # set while it is dead and waiting out its back-off
        self.start()

    def start(self, now: float | None = None) -> None:
        self.started = time.monotonic() if now is None else now
        self.proc = self.launch()
        self.pid_file.write_text(f"{self.proc.pid}\n")  # for operators (and tests) to find it

    def tend(self, now: float) -> str | None:
        """Start it again if it died and its back-off has passed; what happened, in words."""
        if self.proc.poll() is None:
            return None
        if self.restart_at is None:
            ran = now - self.started
            if ran >= STEADY_S:
                self.backoff.reset()
            delay = self.backoff.next()
            self.restart_at = now + delay
            return (f"{self.name} exited with code {self.proc.returncode} after {ran:.0f}s; "
                    f"restarting in {delay:g}s")
        if now < self.restart_at:
            return None
        self.restart_at = None
        try:
            self.start(now)
        except (OSError, RuntimeError) as exc:  # e.g. Redis's port taken: the next back-off is longer
            return f"{self.name} did not start again: {exc}"
        return f"{self.name} restarted (pid {self.proc.pid})"

    def tail(self) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])


class Stack:
    """Redis, worker, gateway, Celery: started, restarted when they die, all stopped on exit."""

    def __init__(self, state_dir: Path):
        self.state = state_dir
        self.redis: RedisServer | None = None
        self.children: list[Child] = []
        self._up_log = JsonFormatter("up")

    def start_redis(self, port: int, password: str) -> RedisServer:
        # persistent (append-only, fsync every second): keys, limits and queued requests outlive a
        # restart of Redis, which supervision does on its own
        self.redis = RedisServer(port=port, data_dir=self.state / "redis", password=password,
                                 persist=True)
        self.children.append(Child("redis", lambda: self.redis.start().proc, None,
                                   self.state / "redis.pid"))
        return self.redis

    def spawn(self, name: str, args: list[str], env: dict) -> None:
        log = self.state / f"{name}.log"

        def launch() -> subprocess.Popen:
            with open(log, "ab") as out:
                return subprocess.Popen([sys.executable, "-m", "kvgate", *args], env=env, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.children.append(Child(name, launch, log, self.state / f"{name}.pid"))

    def dead_child(self) -> str | None:
        """Before the stack was ever ready: which child died, with its last log lines."""
        for child in self.children:
            if child.proc.poll() is not None:
                where = f" (see {child.log}); its last lines:\n{child.tail()}" if child.log else ""
                return f"{child.name} exited with code {child.proc.returncode}{where}"
        return None

    def supervise(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if (news := child.tend(now)) is not None:
                self._say(child, news)

    def _say(self, child: Child, news: str) -> None:
        print(f"kvgate up: {news}", file=sys.stderr, flush=True)
        if child.log is not None:  # a JSON line like the child's own, so its log tells the story
            record = logging.makeLogRecord({"name": "kvgate.up", "levelname": "WARNING",
                                            "levelno": logging.WARNING, "msg": news})
            with open(child.log, "a") as out:
                out.write(self._up_log.format(record) + "\n")

    def stop(self) -> None:
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        for child in reversed(self.children):
            try:
                child.proc.wait(15)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
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


def wait_ready(stack: Stack, url: str, key: str, served_name: str,
               stopping: Callable[[], bool], verify: ssl.SSLContext | bool = True) -> bool:
    """True once the gateway lists the model; False if asked to stop first; a child that dies
    meanwhile ends the wait with an error (no restarts before the stack has been up once)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    headers = {"Authorization": f"Bearer {key}"}
    while time.monotonic() < deadline and not stopping():
        if (why := stack.dead_child()) is not None:
            raise RuntimeError(f"{why}\nnot restarting: the stack was never ready")
        try:
            models = httpx.get(f"{url}/v1/models", headers=headers, timeout=2, verify=verify)
            if models.status_code == 200 and any(m["id"] == served_name for m in models.json()["data"]):
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    if stopping():
        return False
    raise RuntimeError(f"stack not ready after {READY_TIMEOUT_S}s")


def run_up(model, served_name, version_, engine, port, redis_port, state_dir,
           gateway_workers: int = 1, redis_url: str | None = None, tls: bool = False) -> int:
    state = Path(state_dir).resolve()
    state.mkdir(parents=True, exist_ok=True)
    model_dir = Path(model).resolve() if model else default_model_dir()
    served_name = served_name or (served_name_for(model_dir) if model else "demo")
    port = port or free_port()
    stack = Stack(state)
    stopping = False

    def on_signal(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        redis_url, broker = redis_for(stack, redis_port, redis_url)
        key = "sk-kvg-dev-" + secrets.token_urlsafe(24)
        admin_key = "sk-kvg-admin-" + secrets.token_urlsafe(24)
        # the Redis URL (it carries the password) goes by environment, never on a command line
        env = {**os.environ, "KVGATE_REDIS_URL": redis_url, **broker,
               "KVGATE_DATA_DIR": os.environ.get("KVGATE_DATA_DIR", str(state / "data"))}
        # The worker shares this machine: OpenMP threads on every core, spinning while the
        # gateway and Redis want a core, cost ~20% of tokens/s at 64 streams on 2 cores.
        threads = os.environ.get("KVGATE_TORCH_THREADS") or str(max(1, (os.cpu_count() or 2) // 2))
        metrics_port = os.environ.get("KVGATE_METRICS_PORT") or str(free_port())  # kept by a restart
        certs = dev_certs(state / "tls") if tls else None
        stack.spawn("worker", ["worker", "--model", str(model_dir), "--served-name", served_name,
                               "--version", version_, "--engine", engine],
                    {**env, "KVGATE_TORCH_THREADS": threads, "KVGATE_METRICS_PORT": metrics_port,
                     **tls_env(certs, "KVGATE_METRICS_SSL_CERTFILE", "KVGATE_METRICS_SSL_KEYFILE")})
        stack.spawn("gateway", ["gateway", "--port", str(port), "--workers", str(gateway_workers)],
                    {**env, "KVGATE_API_KEY": key, "KVGATE_ADMIN_KEY": admin_key,
                     "KVGATE_SECRET": server_secret(state),
                     # in the state folder: a gateway killed and restarted reuses it (emptied at its
                     # start) rather than leaving a folder of its own in /tmp each time
                     "PROMETHEUS_MULTIPROC_DIR": os.environ.get("PROMETHEUS_MULTIPROC_DIR",
                                                                str(state / "gateway-metrics")),
                     **tls_env(certs, "KVGATE_SSL_CERTFILE", "KVGATE_SSL_KEYFILE")})
        url = f"{'https' if certs else 'http'}://127.0.0.1:{port}"
        # Celery's batch lines go through the gateway: with TLS, trusting the development CA
        trust = {"SSL_CERT_FILE": str(certs.ca)} if certs else {}
        spawn_services(stack, {**env, "KVGATE_GATEWAY_URL": url, "KVGATE_SECRET": server_secret(state),
                               **trust})
        verify = ssl.create_default_context(cafile=str(certs.ca)) if certs else True
        if not wait_ready(stack, url, key, served_name, lambda: stopping, verify):
            return 0
        metrics_url = worker_metrics_url(redis_url, served_name)
        (state / "worker.metrics.url").write_text(metrics_url + "\n")
        _write_state(state, url, redis_url, key, admin_key, model_dir)
        _announce(url, key, served_name, state, model_dir)
        if certs:
            print(trust_hint(certs.ca, url), flush=True)
        while not stopping:
            stack.supervise()
            time.sleep(0.3)
        return 0
    except RuntimeError as exc:
        print(f"kvgate up: {exc}", file=sys.stderr)
        return 1
    finally:
        print("kvgate up: stopping", file=sys.stderr)
        stack.stop()


def tls_env(certs: DevCerts | None, cert_var: str, key_var: str) -> dict[str, str]:
    """The variables that serve a process's port with the development certificate."""
    return {cert_var: str(certs.cert), key_var: str(certs.key)} if certs else {}


def redis_for(stack: Stack, port: int, redis_url: str | None) -> tuple[str, dict[str, str]]:
    """The Redis the stack meets at: the one given (any mode), else one started here; and the
    broker's URL where Celery needs its own (it cannot use a cluster): then the one started here."""
    from shared.settings import CommonSettings

    if redis_url is None:
        return stack.start_redis(port, redis_password(stack.state)).url, {}
    settings = CommonSettings(redis_url=redis_url)  # the mode and broker from the environment
    if settings.redis_mode == "single" or settings.broker_url:
        return redis_url, {}
    return redis_url, {"KVGATE_BROKER_URL": stack.start_redis(port, redis_password(stack.state)).url}


def worker_metrics_url(redis_url: str, served_name: str) -> str:
    """The /metrics URL the live worker of `served_name` put in its registry entry."""
    import orjson

    from shared import names
    from shared.redis_client import sync_client
    from shared.settings import CommonSettings

    client = sync_client(CommonSettings(redis_url=redis_url))
    try:
        for worker_id in client.zrange(names.WORKERS_ZSET, 0, -1):
            raw = client.get(names.worker_key(worker_id.decode()))
            info = orjson.loads(raw) if raw else {}
            if info.get("served_name") == served_name and info.get("metrics_url"):
                return info["metrics_url"]
    finally:
        client.close()
    raise RuntimeError("the worker did not say where its metrics are")


def redis_password(state: Path) -> str:
    """The embedded Redis's password, generated once and kept in the state folder (mode 0600), so
    another local user cannot read or edit keys through Redis's port."""
    path = state / "redis.password"
    if not path.exists():
        write_secret(path, secrets.token_urlsafe(32))
    return path.read_text().strip()


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
    write_secret(state / "redis.url", redis_url)  # it carries the password
    (state / "model.dir").write_text(str(model_dir) + "\n")
    write_secret(state / "admin.key", admin_key)
    write_secret(state / "dev.key", key)  # last: scripts wait for it


def _announce(url: str, key: str, served_name: str, state: Path, model_dir: Path) -> None:
    print(f"kvgate is up at {url}  (model '{served_name}')")
    print(f"dev key: {key}")
    print(f"admin key: in {state / 'admin.key'} (for `kvgate keys ...` and /admin)")
    worker_metrics = (state / "worker.metrics.url").read_text().strip()
    print(f"metrics: {url}/metrics (gateway), {worker_metrics} (worker)")
    print("try:")
    task = _task(model_dir)
    if task == "embed":
        print(f"  curl {url}/v1/embeddings -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{served_name}\", \"input\": [\"Hello\", \"world\"]}}'", flush=True)
        return
    if task == "score":
        print(f"  curl {url}/v1/rerank -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{served_name}\", \"query\": \"Hello\", \"documents\": [\"Hi there\", "
              f"\"Goodbye\"]}}'", flush=True)
        return
    print(f"  curl -N {url}/v1/chat/completions -H 'Authorization: Bearer {key}' "
          f"-H 'Content-Type: application/json' -d '{{\"model\": \"{served_name}\", \"stream\": true, "
          f"\"max_tokens\": 32, \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'",
          flush=True)


def _task(model_dir: Path) -> str:
    """The worker's task ("generate", "embed", "score"): KVGATE_TASK, KVGATE_SCORE_TOKENS and the
    folder decide it (worker/models/pooling.py)."""
    from shared.settings import WorkerSettings
    from worker.models.pooling import read_pooling

    settings = WorkerSettings(model=str(model_dir))
    try:
        pooling = read_pooling(model_dir, settings.task, tuple(t for t in settings.score_tokens.split(",") if t))
    except ValueError:  # the worker says why, in its log
        return "generate"
    return "generate" if pooling is None else "score" if pooling.scores else "embed"
