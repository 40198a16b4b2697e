"""A gateway stopped by a signal takes its Prometheus multiprocess folder with it: uvicorn ends
by raising the signal again, which skipped the clean-up, and every stop left a folder in /tmp
(287 of them on a development machine after a day of test runs)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from shared.redis_server import free_port
from tests.integration.test_faults import _wait


# the exit status each signal gave before the clean-up existed: SIGTERM is raised again by uvicorn
# and kills the process; SIGINT's is Python's KeyboardInterrupt, which ends it normally
@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 0)])
def test_a_signalled_gateway_removes_its_metrics_folder_and_ends_as_before(redis_server, tmp_path, sig, status):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(TMPDIR=str(scratch), KVGATE_SECRET="exit-test-secret")
    port = free_port()
    with open(tmp_path / "gateway.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvgate", "gateway", "--port", str(port),
                                 "--redis-url", redis_server.url], stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    try:
        _wait(lambda: httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200, proc)
        folders = list(scratch.glob("kvgate-metrics-*"))
        assert len(folders) == 1 and any(folders[0].glob("*.db")), folders  # in use while it runs
        proc.send_signal(sig)
        assert proc.wait(30) == status
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not list(scratch.glob("kvgate-metrics-*"))
