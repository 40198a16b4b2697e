#!/usr/bin/env bash
# The GPU check: Triton kernel correctness (bf16), decode-attention bandwidth against the GPU's peak
# and torch SDPA, engine throughput against transformers. At most 8 minutes on an H200.
#
#   ops/gpu/check.sh [OUT_JSON]        default docs/perf/gpu-check.json
#
# Installs nothing (GPU machines may have no network): uses PYTHON, else the repo's .venv when its
# torch sees a GPU, else python3; the repo is put on PYTHONPATH. WITH_TESTS=1 also runs the kernel
# tests compiled on the GPU first (about a minute more).
set -euo pipefail
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
"$py" -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'

if [[ "${WITH_TESTS:-0}" == 1 ]]; then
  TRITON_INTERPRET=0 timeout 120 "$py" -m pytest -q -p no:cacheprovider tests/worker/kernels \
    -o addopts="" || echo "kernel tests on the GPU failed (continuing with the check)"
fi
timeout 480 "$py" ops/gpu/check.py "$@"
