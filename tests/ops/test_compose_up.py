"""`make compose-check` as a test (marker `compose`, not in `make test`): the compose stack built and
brought up for real in podman and used as a user would (ops/compose/check.py says what it checks).
Needs root, podman, debootstrap and docker-compose: `pytest -m compose tests/ops/test_compose_up.py`."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PHASES = ["base image", "images", "podman service", "up -d", "streamed chat", "--scale worker-cpu=2",
          "prometheus targets", "down -v"]


@pytest.mark.compose
@pytest.mark.timeout(3600)
def test_compose_stack_comes_up_serves_scales_and_goes_away():
    out = subprocess.run([sys.executable, str(ROOT / "ops/compose/check.py")], cwd=ROOT,
                         capture_output=True, text=True, timeout=3500)
    tail = out.stdout[-8000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    report = out.stdout.split("compose-check phases:")[-1]
    for phase in PHASES:
        assert any(line.strip().startswith(phase) and line.rstrip().endswith("ok")
                   for line in report.splitlines()), f"phase {phase!r} did not pass:\n{tail}"
