#!/usr/bin/env bash
# The GPU check: Triton kernel correctness (bf16), decode-attention bandwidth against the GPU's peak
# and torch SDPA, engine throughput against transformers, CUDA-graph decode against eager. Each
# section in a process of its own; at most 8 minutes on an H200 (check.py keeps to 460 s of its own,
# this kills it at 480 s).
#
#   ops/gpu/check.sh [OUT_JSON] [check.py options]     OUT_JSON default docs/perf/gpu-check.json
#
# On the device machine only what is written under $OUT comes back; there, with a timeout above
# 480 s (docs/performance.md has the exact call):
#   set -o pipefail; ops/gpu/check.sh $OUT/gpu-check.json 2>&1 | tee $OUT/check.log
# A relative OUT_JSON is taken from the directory this is started in.
#
# Installs nothing (GPU machines may have no network): uses PYTHON, else the repo's .venv when its
# torch sees a GPU, else python3; the repo is put on PYTHONPATH. WITH_TESTS=1 first runs the kernel
# tests compiled on the GPU (about a minute more), without the two that are for machines with no
# GPU: the --smoke run of check.py (Triton's interpreter, which in triton 3.6 — the H200 image's —
# cannot run the kernels with numpy >= 2.4 at all) and the sm_90 compile check (this run compiles).
set -euo pipefail

args=()
for arg in "$@"; do
  if [[ "$arg" == *.json && "$arg" != /* ]]; then
    arg="$PWD/$arg"  # before the cd below
  fi
  args+=("$arg")
done
cd "$(dirname "$0")/../.."

py="${PYTHON:-}"
if [[ -z "$py" ]]; then
  py=python3
  if [[ -x .venv/bin/python ]] && .venv/bin/python -c \
      'import sys, torch, triton; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    py=.venv/bin/python
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
"$py" -c 'import numpy, torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "numpy", numpy.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'

if [[ "${WITH_TESTS:-0}" == 1 ]]; then
  echo "WITH_TESTS=1: the kernel tests compiled on this GPU; test_gpu_check_smoke.py (interpreted) and" \
    "test_compiles_for_hopper.py (no GPU needed) are left to CPU machines"
  TRITON_INTERPRET=0 timeout 120 "$py" -m pytest -q -p no:cacheprovider tests/worker/kernels -o addopts="" \
    --deselect tests/worker/kernels/test_gpu_check_smoke.py \
    --deselect tests/worker/kernels/test_compiles_for_hopper.py \
    || echo "kernel tests on the GPU failed (continuing with the check)"
fi
timeout 480 "$py" ops/gpu/check.py ${args[@]+"${args[@]}"}
