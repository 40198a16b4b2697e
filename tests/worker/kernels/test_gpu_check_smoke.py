"""ops/gpu/check.py is run on a GPU machine only now and then: keep it working by running every
section of it on tiny shapes here (Triton interpreted)."""
import json
import os
import subprocess
import sys
from pathlib import Path

CHECK = Path(__file__).resolve().parents[3] / "ops" / "gpu" / "check.py"
STABLE = ("decode_attn.bw_share", "decode_attn.vs_sdpa", "engine.vs_sequential", "engine.vs_static",
          "engine.cuda_graph_speedup")


def test_every_section_runs_and_reports_the_stable_names(tmp_path):
    out = tmp_path / "check.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(CHECK), str(out), "--smoke"], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert not [k for k in report if k.endswith(".error")], report
    assert all(name in report for name in STABLE), sorted(report)
    assert all(report[k] for k in report if k.endswith(".ok")), report
