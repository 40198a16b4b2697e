"""`kvgate gateway` raises its soft limit on open files to the hard one: at a soft limit of 256,
300 idle connections from anyone left the gateway resetting every new connection (and unable to
open Redis connections) until the head deadline closed them; raised, the same 300 leave it serving."""
from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys

import httpx

from shared.redis_server import free_port
from tests.conftest import stop_stack
from tests.integration.test_faults import _wait


def _soft_limit(pid: int) -> int:
    for row in open(f"/proc/{pid}/limits"):
        if row.startswith("Max open files"):
            return int(row.split()[3])
    raise AssertionError("no open-files row")


def test_the_gateway_takes_the_hard_limit_on_open_files_and_serves_past_the_soft_one(redis_server, tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard == resource.RLIM_INFINITY or hard >= 1024, "the test needs room above 256"
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(KVGATE_SECRET="files-test-secret", KVGATE_API_KEY="sk-files")
    port = free_port()
    with open(tmp_path / "gateway.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvgate", "gateway", "--port", str(port),
                                 "--redis-url", redis_server.url], stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True,
                                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    idle: list[socket.socket] = []
    try:
        _wait(lambda: httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200, proc)
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
        answer = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10,
                           headers={"Authorization": "Bearer sk-files"})
        assert answer.status_code == 200
        assert _soft_limit(proc.pid) == (hard if hard != resource.RLIM_INFINITY else 1 << 20)
    finally:
        for sock in idle:
            sock.close()
        stop_stack(proc)
