"""The GPU machine's image has torch, triton, numpy, tqdm and typing_extensions (and transformers,
tokenizers, safetensors), but none of kvgate's service dependencies (pydantic, orjson, redis ...):
the engine and the GPU check must import with those alone, or the owed GPU run dies at its first line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ON_THE_IMAGE = {"numpy", "torch", "torchgen", "triton", "tqdm", "typing_extensions"}

LIST_IMPORTS = """
import importlib.util, json, os, sys
before = set(sys.modules)
import worker.engine.engine, worker.engine.model_runner, worker.engine.triton_attention
spec = importlib.util.spec_from_file_location("gpu_check", "ops/gpu/check.py")
check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = check
spec.loader.exec_module(check)
import check_engine, check_kernels  # the sections, beside check.py on the path it set
new = {name.split(".")[0] for name in set(sys.modules) - before}
def ours(name):  # the repo's own packages (a virtualenv inside the repo is not ours)
    path = os.path.abspath(getattr(sys.modules.get(name), "__file__", None) or "/")
    return path.startswith(os.getcwd() + os.sep) and not path.startswith(sys.prefix + os.sep)
print(json.dumps(sorted(n for n in new if not ours(n) and n not in sys.stdlib_module_names
                        and not n.startswith("_"))))
"""


def test_engine_and_gpu_check_import_only_what_the_gpu_image_has():
    proc = subprocess.run([sys.executable, "-c", LIST_IMPORTS], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = set(json.loads(proc.stdout.splitlines()[-1]))
    assert {"torch", "triton"} <= loaded  # the probe really imported the engine
    assert loaded - ON_THE_IMAGE == set(), "import these lazily, where only the service needs them"
