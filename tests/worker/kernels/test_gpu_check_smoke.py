"""ops/gpu/check.sh is run on a GPU machine only now and then: keep it working by running every
section of it on tiny shapes here (Triton interpreted), the way the device call runs it."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
STABLE = ("decode_attn.bw_share", "decode_attn.vs_sdpa", "engine.vs_sequential", "engine.vs_static",
          "engine.cuda_graph_speedup", "engine.graphs_vs_eager.ok")


def test_the_documented_command_writes_every_section_under_out(tmp_path):
    """Only $OUT comes back from the device machine: the JSON and the log must land there, here
    through a relative $OUT (the script changes directory), and pipefail sees the script's status."""
    (tmp_path / "out").mkdir()
    command = f"set -o pipefail; {ROOT}/ops/gpu/check.sh $OUT/gpu-check.json --smoke 2>&1 | tee $OUT/check.log"
    env = {**os.environ, "OUT": "out", "PYTHON": sys.executable, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert not [k for k in report if k.endswith(".error")], report
    assert all(name in report for name in STABLE), sorted(report)
    assert all(report[k] for k in report if k.endswith(".ok")), report
    assert report["engine.graphs.graph_steps"] > 0  # the graphs variant's decode steps took the padded path
    assert "| engine.vs_sequential |" in (tmp_path / "out" / "check.log").read_text()


def test_a_section_process_that_dies_leaves_the_others_figures(tmp_path):
    """A CUDA error is sticky for its process: the graphs variant dying (here: aborting, a test-only
    fault) must not void the transformers baselines or the eager run, which ran in processes of their own."""
    out = tmp_path / "check.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "ops" / "gpu" / "check.py"), str(out), "--smoke",
                           "--only", "engine", "--fault", "engine.graphs"],
                          env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "process exited with status" in report["engine.graphs.error"]
    assert [k for k in report if k.endswith(".error")] == ["engine.graphs.error"]
    assert report["hf.sequential.tokens_per_s"] > 0 and report["engine.eager.tokens_per_s"] > 0
    assert report["engine.vs_sequential"] > 0 and report["engine.cuda_graph_speedup"] is None
