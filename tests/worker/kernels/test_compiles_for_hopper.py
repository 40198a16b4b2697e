"""The interpreter accepts code the GPU compiler rejects: build the kernels for sm_90, no GPU needed."""
import os
import subprocess
import sys
from pathlib import Path

CHECK = Path(__file__).resolve().parents[3] / "ops" / "gpu" / "compile_check.py"


def test_kernels_compile_for_sm90_without_spills():
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # interpreted triton cannot compile
    proc = subprocess.run([sys.executable, str(CHECK), "--quick"], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
