"""SIGTERM stops a worker that has nothing in flight at once, even while Redis is away (it used
to wait for Redis forever, holding its model and KV memory)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from shared.redis_server import free_port


def test_sigterm_stops_a_worker_that_waits_for_redis(tiny_model_dir, tmp_path):
    log = tmp_path / "worker.log"
    env = {**os.environ, "KVGATE_KV_CACHE_MEMORY": str(8 << 20)}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvgate", "worker", "--model", str(tiny_model_dir),
                                 "--served-name", "demo", "--redis-url",
                                 f"redis://127.0.0.1:{free_port()}/0"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while "waiting for Redis" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
