"""`kvgate up` supervises its children: a worker, the gateway, the Celery worker or Redis killed
with SIGKILL is started again and the stack goes on serving; a child that dies before the stack was
ever ready ends `kvgate up` loudly instead. Its Redis wants the password kept in `.kvgate/`."""
from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import redis

from kvgate.up import Child
from tests.conftest import start_stack, stop_stack  # plain helpers

FAST = {"KVGATE_HEARTBEAT_S": "0.3", "KVGATE_HEARTBEAT_TTL_S": "2", "KVGATE_MAINTENANCE_S": "1"}


def _pid(state: Path, name: str) -> int:
    return int((state / f"{name}.pid").read_text())


def _until(condition, timeout: float = 90, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except (httpx.HTTPError, redis.RedisError, OSError, ValueError):
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _kill(state: Path, name: str) -> int:
    old = _pid(state, name)
    os.kill(old, signal.SIGKILL)
    _until(lambda: _pid(state, name) != old, 30, f"{name} to be started again")
    return _pid(state, name)


def _served(url: str, key: str) -> bool:
    resp = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                      json={"model": "demo", "prompt": "still there?", "max_tokens": 4, "ignore_eos": True})
    return resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4


def _task_ran_in(log: Path, pid: int) -> bool:
    """Celery logged a task that succeeded in process `pid` (beat sends maintenance every second)."""
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            entry = orjson.loads(line)
            if entry.get("pid") == pid and " succeeded in " in entry.get("msg", ""):
                return True
    return False


def test_up_restarts_what_dies_and_its_redis_wants_the_password(tiny_model_dir, tmp_path):
    state = tmp_path / "state"
    stack = start_stack(tiny_model_dir, state, "paged", extra_env=FAST)
    password = (state / "redis.password").read_text().strip()
    try:
        # the password: in redis.url (0600), required by Redis, on no process's command line
        assert f":{password}@" in stack.redis_url
        for name in ("redis.url", "redis.password"):
            assert stat.S_IMODE((state / name).stat().st_mode) == 0o600, name
        port = redis.Redis.from_url(stack.redis_url).connection_pool.connection_kwargs["port"]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(b"PING\r\n")
            assert raw.recv(100).startswith(b"-NOAUTH")
        for name in ("redis", "worker", "gateway", "celery-worker", "celery-beat"):
            with open(f"/proc/{_pid(state, name)}/cmdline", "rb") as cmdline:
                assert password.encode() not in cmdline.read(), name

        first = stack.worker_info()["worker_id"]
        new_worker = _kill(state, "worker")
        _until(lambda: any(w["worker_id"] != first for w in _live_workers(stack.redis_url)), 120,
               "a new worker to register")
        _until(lambda: _served(stack.url, stack.key), 60, "a request served by the new worker")

        old_gateway = _pid(state, "gateway")
        new_gateway = _kill(state, "gateway")
        _until(lambda: _served(stack.url, stack.key), 60, "the new gateway to serve")
        # its metrics folder is the state folder's, emptied by the new gateway (none left in /tmp)
        files = [p.name for p in (state / "gateway-metrics").glob("*.db")]
        assert any(name.endswith(f"_{new_gateway}.db") for name in files), files
        assert not any(name.endswith(f"_{old_gateway}.db") for name in files), files

        celery = _kill(state, "celery-worker")
        _until(lambda: _task_ran_in(state / "celery-worker.log", celery), 60,
               "the new Celery worker to run a task")

        admin = {"Authorization": f"Bearer {(state / 'admin.key').read_text().strip()}"}
        made = httpx.post(stack.url + "/admin/keys", json={"name": "survivor"}, headers=admin, timeout=30)
        assert made.status_code == 201, made.text
        time.sleep(1.5)  # the append-only file is written every second
        _kill(state, "redis")  # started again on its append-only file, same password
        _until(lambda: _served(stack.url, stack.key), 60, "the stack to serve from the new Redis")
        assert _served(stack.url, made.json()["secret"]), "a key made before the restart still works"
        assert stack.proc.poll() is None, "kvgate up must stay up"
        assert _pid(state, "worker") == new_worker, "a Redis restart is waited out, not fatal"
    finally:
        stop_stack(stack.proc)
    said = stack.proc.stdout.read().decode(errors="replace")
    print(f"\n[supervision] {said.count(' restarted (pid ')} restarts: "
          + "; ".join(line for line in said.splitlines() if line.startswith("kvgate up: ")))
    assert stack.proc.returncode == 0
    for name in ("worker", "gateway", "celery-worker"):
        assert f"{name} exited with code -9" in said and f"{name} restarted (pid " in said, name
        assert "restarting in 1s" in (state / f"{name}.log").read_text(), name  # its log says so too
    assert password not in said
    for log in state.glob("*.log"):
        assert password not in log.read_text(errors="replace"), log.name


def _live_workers(redis_url: str) -> list[dict]:
    from shared import names

    client = redis.Redis.from_url(redis_url)
    try:
        raws = [client.get(names.worker_key(i.decode())) for i in client.zrange(names.WORKERS_ZSET, 0, -1)]
    finally:
        client.close()
    return [orjson.loads(r) for r in raws if r]


def test_a_child_that_dies_before_the_stack_was_ready_stops_it_loudly(tmp_path):
    broken = tmp_path / "not-a-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "kvgate", "up", "--model", str(broken), "--port", "0",
                           "--state-dir", str(tmp_path / "state")], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 1
    assert "worker exited with code 1" in proc.stderr and "not restarting" in proc.stderr
    assert "its last lines:" in proc.stderr  # the cause is right there, not only in a file


def _exits(code: int):
    return lambda: subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])


def test_restarts_back_off_from_one_second_to_thirty_and_reset_after_a_minute(tmp_path):
    child = Child("flaky", _exits(3), None, tmp_path / "flaky.pid")
    child.proc.wait()
    now, said = child.started, []
    for _ in range(7):  # dies at once every time: 1, 2, 4, 8, 16, 30, 30 s
        said.append(child.tend(now))
        assert child.tend(now + 0.1) is None  # not before its back-off
        now = child.restart_at
        assert child.tend(now).startswith("flaky restarted (pid ")
        child.proc.wait()
    delays = [line.rsplit(" ", 1)[1] for line in said]
    assert delays == ["1s", "2s", "4s", "8s", "16s", "30s", "30s"], said
    assert said[0].startswith("flaky exited with code 3 after ")
    child.started = now - 61  # it ran a minute before this death: back to one second
    assert child.tend(now).endswith("restarting in 1s")
    assert int((tmp_path / "flaky.pid").read_text()) == child.proc.pid
