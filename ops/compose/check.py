"""`make compose-check`: `docker-compose up` for real, in podman, checked from outside as a user would.

Builds (cached) a Debian base with debootstrap, the kvgate image, and Redis and Prometheus images from
Debian's packages; serves the Docker API from podman on a private socket; brings up
docker-compose.yml + docker-compose.cpu.yml + ops/compose/check.yml (no Grafana, OTel collector or
Jaeger: no offline source carries them); then a streamed chat through the official openai client,
`kvgate keys create`, `--scale worker-cpu=2` with both workers serving, Prometheus's targets up and
every dashboard query answered with data; then `down -v`, leaving nothing behind. Prints each phase's
time. Needs root, podman, debootstrap and docker-compose (Debian packages). Run with the project's
Python (it uses openai, httpx and PyYAML): `.venv/bin/python ops/compose/check.py`.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # shared.redis_server.free_port; this folder is on the path already
from user_load import dashboard_load, stream_chat  # noqa: E402

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvgate" / "compose-check"
MIRROR = os.environ.get("KVGATE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE = "localhost/kvgate-debian:bookworm"
IMAGES = {  # tag -> (Containerfile, whether pip inside needs the machine's configuration)
    "localhost/kvgate:latest": ("ops/docker/Dockerfile", True),
    "localhost/kvgate-redis:check": ("ops/compose/redis.Containerfile", False),
    "localhost/kvgate-prometheus:check": ("ops/compose/prometheus.Containerfile", False),
}
PROJECT = "kvgate-check"
FILES = ["docker-compose.yml", "docker-compose.cpu.yml", "ops/compose/check.yml"]
# podman's default rlimits are refused in some sandboxes (runc: "error setting rlimit type 6")
ULIMITS = ("nofile=4096:4096", "nproc=4096:4096")
PIP_VARS = {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_TRUSTED_HOST", "PIP_CERT",
            "PIP_CONSTRAINT", "PIP_DEFAULT_TIMEOUT"}  # the ARGs ops/docker/Dockerfile declares
HEALTHY_TIMEOUT_S = 600


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    shown = ["***" if prev == "--admin-key" else str(arg) for prev, arg in zip([None, *cmd], cmd)]
    print("+", " ".join(shown), flush=True)  # a key never goes to the log
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def quiet(cmd: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)


class Phases:
    """Times each phase and prints them all at the end, failed or not."""

    def __init__(self):
        self.times: list[tuple[str, float, str]] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        print(f"\n== {name}", flush=True)
        start, outcome = time.monotonic(), "FAILED"
        try:
            yield
            outcome = "ok"
        finally:
            self.times.append((name, time.monotonic() - start, outcome))
            print(f"== {name}: {outcome} in {time.monotonic() - start:.1f}s", flush=True)

    def report(self) -> None:
        print("\ncompose-check phases:")
        for name, seconds, outcome in self.times:
            print(f"  {name:<34} {seconds:7.1f}s  {outcome}")
        print(f"  {'total':<34} {sum(t for _, t, _ in self.times):7.1f}s", flush=True)


# -- images -------------------------------------------------------------------------------------

def build_base() -> None:
    """Debian bookworm (minbase, python3 with venv) from the package mirror, kept as a tar."""
    if quiet(["podman", "image", "exists", BASE]).returncode == 0:
        print(f"{BASE}: cached")
        return
    tar = CACHE / "debian-bookworm.tar"
    if not tar.exists():
        rootfs = CACHE / "rootfs"
        shutil.rmtree(rootfs, ignore_errors=True)
        run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
             "bookworm", rootfs, MIRROR])
        for deb in (rootfs / "var/cache/apt/archives").glob("*.deb"):
            deb.unlink()
        run(["tar", "-C", rootfs, "-cf", tar.with_suffix(".tmp"), "."])
        tar.with_suffix(".tmp").rename(tar)
        shutil.rmtree(rootfs)
    run(["podman", "import", tar, BASE])


def pip_build_args() -> list[str]:
    """The machine's pip configuration as build arguments, each local folder it names mounted at
    the same path, so pip inside the build finds what pip here finds (the CPU torch wheel too)."""
    config: dict[str, str] = {}
    listed = quiet([sys.executable, "-m", "pip", "config", "list"], check=True).stdout
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        var = "PIP_" + key.split(".", 1)[-1].upper().replace("-", "_")
        if var in PIP_VARS and (key.startswith(":env:") or var not in config):  # env beats files
            config[var] = value.strip().strip("'\"")
    mounts = set()
    for value in config.values():
        for item in value.split():
            path = urlparse(item).path if item.startswith("file:") else item
            if item.startswith("file:") and path.rstrip("/").endswith("/simple"):
                path = str(Path(path).parent)  # the index links to ../../files
            if path.startswith("/") and Path(path).exists():
                mounts.add(path)
    args = [a for var, value in sorted(config.items()) for a in ("--build-arg", f"{var}={value}")]
    return args + [a for m in sorted(mounts) for a in ("--volume", f"{m}:{m}:ro")]


def build_images() -> None:
    pip = pip_build_args()
    for tag, (containerfile, needs_pip) in IMAGES.items():
        run(["podman", "build", "--file", containerfile, "--build-arg", f"BASE={BASE}",
             "--ignorefile", "ops/docker/Dockerfile.dockerignore",
             *[a for u in ULIMITS for a in ("--ulimit", u)], *(pip if needs_pip else []),
             "--tag", tag, "."], cwd=ROOT)
    size = quiet(["podman", "image", "inspect", "--format", "{{.Size}}", "localhost/kvgate:latest"])
    print(f"kvgate image: {int(size.stdout.strip()) / 1e6:.0f} MB")


# -- the engine -----------------------------------------------------------------------------------

class Engine:
    """`podman system service` on a private socket, with the ulimits this machine accepts."""

    def __init__(self):
        self.dir = CACHE / "run"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sock = self.dir / "podman.sock"
        conf = self.dir / "containers.conf"
        conf.write_text("[containers]\ndefault_ulimits = [%s]\n" % ", ".join(f'"{u}"' for u in ULIMITS))
        self.sock.unlink(missing_ok=True)
        log = open(self.dir / "service.log", "ab")
        self.proc = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{self.sock}"],
                                     env={**os.environ, "CONTAINERS_CONF": str(conf)},
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        client = httpx.Client(transport=httpx.HTTPTransport(uds=str(self.sock)))
        _wait(lambda: _answers(client, "http://d/_ping"), "the podman service", 60)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _answers(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class HealthChecks(threading.Thread):
    """podman schedules healthchecks with systemd timers; where there is no systemd they never run,
    and compose waits for `service_healthy` forever. This runs each container's at its interval."""

    def __init__(self):
        super().__init__(daemon=True)
        self.done = threading.Event()
        self.next_at: dict[str, float] = {}
        self.running: set[str] = set()  # one check per container at a time, all containers at once

    def run(self) -> None:
        while not self.done.wait(1):
            for name, interval in project_healthchecks().items():
                if name not in self.running and time.monotonic() >= self.next_at.get(name, 0):
                    self.next_at[name] = time.monotonic() + interval
                    self.running.add(name)
                    threading.Thread(target=self._check, args=(name,), daemon=True).start()

    def _check(self, name: str) -> None:
        try:
            quiet(["podman", "healthcheck", "run", name], timeout=60)
        finally:
            self.running.discard(name)


def project_containers(all_: bool = False) -> list[dict]:
    out = quiet(["podman", "ps", *(["-a"] if all_ else []), "--format", "json",
                 "--filter", f"label=com.docker.compose.project={PROJECT}"])
    return json.loads(out.stdout or "[]")


def project_healthchecks() -> dict[str, float]:
    """Running containers with a healthcheck: name -> interval in seconds."""
    names = [c["Names"][0] for c in project_containers()]
    if not names:
        return {}
    inspected = json.loads(quiet(["podman", "inspect", *names]).stdout or "[]")
    return {c["Name"]: max(2.0, c["Config"]["Healthcheck"].get("Interval", 0) / 1e9)
            for c in inspected if c["Config"].get("Healthcheck", {}).get("Test")}


def health(name: str) -> str:
    out = quiet(["podman", "inspect", "--format", "{{.State.Health.Status}}", name])
    return out.stdout.strip()


# -- compose --------------------------------------------------------------------------------------

class Compose:
    def __init__(self, engine: Engine):
        self.gateway_port, self.prometheus_port = _free_port(), _free_port()
        keep = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
        self.env = {**keep, "DOCKER_HOST": f"unix://{engine.sock}", "COMPOSE_HTTP_TIMEOUT": "600",
                    "KVGATE_GATEWAY_PORT": str(self.gateway_port),
                    "KVGATE_PROMETHEUS_PORT": str(self.prometheus_port)}
        self.url = f"http://127.0.0.1:{self.gateway_port}"
        self.prometheus = f"http://127.0.0.1:{self.prometheus_port}"

    def __call__(self, *args: str, capture: bool = False) -> subprocess.CompletedProcess:
        cmd = ["docker-compose", "-p", PROJECT, *[a for f in FILES for a in ("-f", f)], *args]
        if capture:
            return subprocess.run(cmd, cwd=ROOT, env=self.env, check=True, capture_output=True,
                                  text=True, timeout=120)
        return run(cmd, cwd=ROOT, env=self.env, timeout=HEALTHY_TIMEOUT_S)

    def secret(self, name: str) -> str:
        """What a user reads to find a key: it lives on the secrets volume."""
        return self("exec", "-T", "gateway", "cat", f"/secrets/{name}", capture=True).stdout.strip()

    def wait_healthy(self, expect: dict[str, int]) -> None:
        """Every container with a healthcheck healthy, and `expect[service]` of each running."""
        def ready() -> bool:
            running = project_containers()
            count = {s: sum(c["Labels"].get("com.docker.compose.service") == s for c in running)
                     for s in expect}
            states = {c["Names"][0]: health(c["Names"][0]) for c in running}
            print("  " + ", ".join(f"{n}={s or 'up'}" for n, s in sorted(states.items())), flush=True)
            return count == expect and all(s in ("", "healthy") for s in states.values())
        _wait(ready, f"healthy containers {expect}", HEALTHY_TIMEOUT_S, every=5)


def _free_port() -> int:
    from shared.redis_server import free_port

    return free_port()


def _wait(ok, what: str, timeout: float, every: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():
            return
        time.sleep(every)
    raise TimeoutError(f"timed out waiting for {what}")


# -- what a user does ------------------------------------------------------------------------------

def chat_and_keys(compose: Compose) -> None:
    key, admin = compose.secret("KVGATE_API_KEY"), compose.secret("KVGATE_ADMIN_KEY")
    _wait(lambda: _lists_model(compose.url, key), "the gateway to list model demo", 300, every=2)
    print("streamed:", repr(stream_chat(compose.url, key)))
    out = run([sys.executable, "-m", "kvgate", "keys", "create", "--name", "compose-check",
               "--url", compose.url, "--admin-key", admin], cwd=ROOT, capture_output=True, text=True)
    made = next(w for w in out.stdout.split() if w.startswith("sk-"))
    print("kvgate keys create: made a key; it streams too:", repr(stream_chat(compose.url, made)))


def _lists_model(url: str, key: str) -> bool:
    try:
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=3)
        return models.status_code == 200 and any(m["id"] == "demo" for m in models.json()["data"])
    except httpx.HTTPError:
        return False


def two_workers_serve(compose: Compose) -> None:
    key = compose.secret("KVGATE_API_KEY")

    def both_served() -> bool:
        for _ in range(4):
            stream_chat(compose.url, key)
        served = _prom(compose, "sum by (instance) (kvgate_request_success_total)")
        print("  requests finished per worker:", {r["metric"]["instance"]: r["value"][1] for r in served})
        return len(served) == 2 and all(float(r["value"][1]) > 0 for r in served)
    _wait(both_served, "both workers to serve requests", 180, every=1)


def _prom(compose: Compose, expr: str) -> list[dict]:
    answer = httpx.get(f"{compose.prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def prometheus_sees_everything(compose: Compose) -> None:
    def targets_up() -> bool:
        active = httpx.get(f"{compose.prometheus}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        up = {(t["labels"]["job"], t["labels"]["instance"]) for t in active if t["health"] == "up"}
        print("  targets up:", sorted(up))
        jobs = [job for job, _ in up]
        return jobs.count("kvgate-gateway") == 1 and jobs.count("kvgate-worker") == 2
    _wait(targets_up, "Prometheus's targets (a gateway, two workers) up", 120, every=5)
    exprs = dashboard_load(compose.url, compose.secret("KVGATE_API_KEY"),
                           compose.secret("KVGATE_ADMIN_KEY"), lambda e: _prom(compose, e))
    empty: list[str] = []

    def all_have_data() -> bool:
        empty[:] = [f"{title}: {expr}" for title, expr in exprs if not _prom(compose, expr)]
        print(f"  dashboard queries without data: {len(empty)} of {len(exprs)}", flush=True)
        return not empty
    try:
        _wait(all_have_data, "every dashboard query to return data", 120, every=5)
    except TimeoutError:
        raise AssertionError("dashboard queries without data:\n" + "\n".join(empty)) from None


def down_leaves_nothing(compose: Compose) -> None:
    compose("down", "-v", "--remove-orphans", "--timeout", "20")
    left = [c["Names"][0] for c in project_containers(all_=True)]
    volumes = quiet(["podman", "volume", "ls", "--quiet", "--filter",
                     f"label=com.docker.compose.project={PROJECT}"]).stdout.split()
    assert not left and not volumes, f"left behind: containers {left}, volumes {volumes}"


def main() -> int:
    for tool in ("podman", "debootstrap", "docker-compose"):
        if shutil.which(tool) is None:
            print(f"compose-check needs {tool}: apt-get install podman debootstrap docker-compose")
            return 2
    CACHE.mkdir(parents=True, exist_ok=True)
    phases, engine, compose, checks = Phases(), None, None, HealthChecks()
    try:
        with phases.phase("base image (debootstrap, cached)"):
            build_base()
        with phases.phase("images (kvgate, redis, prometheus)"):
            build_images()
        with phases.phase("podman service"):
            engine = Engine()
            compose = Compose(engine)
            checks.start()
            compose("down", "-v", "--remove-orphans")  # what an interrupted run left
        with phases.phase("up -d, every healthcheck healthy"):
            compose("up", "-d", "--no-build")
            compose.wait_healthy({"gateway": 1, "worker-cpu": 1, "redis": 1, "prometheus": 1,
                                  "celery-worker": 1, "celery-beat": 1})
        with phases.phase("streamed chat, kvgate keys create"):
            chat_and_keys(compose)
        with phases.phase("--scale worker-cpu=2, both serving"):
            compose("up", "-d", "--no-build", "--scale", "worker-cpu=2")
            compose.wait_healthy({"gateway": 1, "worker-cpu": 2})
            two_workers_serve(compose)
        with phases.phase("prometheus targets, dashboard data"):
            prometheus_sees_everything(compose)
        with phases.phase("down -v"):
            down_leaves_nothing(compose)
        return 0
    except (Exception, KeyboardInterrupt) as exc:  # said, with the containers' logs; then cleaned up
        print(f"\ncompose-check FAILED: {type(exc).__name__}: {exc}", flush=True)
        if compose is not None:
            subprocess.run(["docker-compose", "-p", PROJECT, *[a for f in FILES for a in ("-f", f)],
                            "logs", "--tail", "30"], cwd=ROOT, env=compose.env)
            subprocess.run(["docker-compose", "-p", PROJECT, *[a for f in FILES for a in ("-f", f)],
                            "down", "-v", "--remove-orphans", "--timeout", "10"], cwd=ROOT, env=compose.env)
        return 1
    finally:
        checks.done.set()
        if engine is not None:
            engine.stop()
        phases.report()


if __name__ == "__main__":
    sys.exit(main())
