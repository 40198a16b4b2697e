"""What `--dtype auto` means: the checkpoint's dtype on a GPU; on a CPU, fp32 unless bf16 is both
native and faster there.

On CPU the choice goes by the CPU's flags first, then a start-up measurement:
- no avx512_bf16, amx_bf16 (x86) or bf16 (Arm) flag: bf16 GEMMs are emulated through fp32 (AMD
  EPYC before Zen 4, Intel before Cooper Lake), slower and less exact, so fp32 without measuring;
- an fp32 (or unknown) checkpoint stays fp32: auto never computes below the precision the weights
  were saved in (and fp32 test models keep matching transformers token for token);
- else one decode-shaped and one prefill-shaped GEMM of the model's own MLP are timed in both
  dtypes (best of 3, well under a second) and bf16 is taken only when clearly faster: the flag
  says the instructions exist, not that this torch build and this core count use them well.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

log = logging.getLogger("kvgate.worker")
NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 AVX-512/AMX, Arm's FEAT_BF16
SIXTEEN_BIT = {"bfloat16", "float16"}
BF16_MARGIN = 0.9  # bf16 must take at most 90% of fp32's time: it costs precision, so win clearly


def choose_dtype(requested: str, device: torch.device, checkpoint_dtype: str | None,
                 hidden_size: int, intermediate_size: int,
                 flags: set[str] | None = None) -> tuple[torch.dtype, str]:
    """(dtype, why in words) for the weights, activations and KV cache; `flags`: the CPU's native
    bf16 flags (None: read this CPU's)."""
    if requested != "auto":
        return getattr(torch, requested), "--dtype"
    if device.type != "cpu":
        return getattr(torch, checkpoint_dtype or "float32"), "auto: the checkpoint's dtype on a GPU"
    flags = native_bf16_flags() if flags is None else flags
    if not flags:
        return torch.float32, "auto: fp32 on this CPU (no avx512_bf16/amx_bf16 flag: bf16 is emulated)"
    if checkpoint_dtype not in SIXTEEN_BIT:
        return torch.float32, f"auto: fp32, the checkpoint's precision ({checkpoint_dtype or 'unknown'})"
    try:
        fp32, bf16 = (gemm_seconds(d, hidden_size, intermediate_size)
                      for d in (torch.float32, torch.bfloat16))
    except RuntimeError as exc:  # a torch build without bf16 kernels for this CPU
        return torch.float32, f"auto: fp32 (a bf16 GEMM failed here: {exc})"
    measured = f"{' '.join(sorted(flags))}; bf16 GEMMs {fp32 / bf16:.2f}x fp32's speed here"
    if bf16 <= BF16_MARGIN * fp32:
        return torch.bfloat16, f"auto: bf16 ({measured})"
    return torch.float32, f"auto: fp32 ({measured}, not faster by {1 / BF16_MARGIN:.2f}x)"


def native_bf16_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The native-bf16 flags of this CPU (empty where /proc/cpuinfo is missing: not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):  # x86, Arm
            return NATIVE_BF16_FLAGS & set(line.split(":", 1)[1].split())
    return set()


@torch.inference_mode()
def gemm_seconds(dtype: torch.dtype, hidden_size: int, intermediate_size: int,
                 rows: tuple[int, ...] = (16, 256), reps: int = 3) -> float:
    """Best-of-`reps` time of the MLP's up projection through the engine's own Linear, summed over
    a decode-sized and a prefill-sized batch."""
    from worker.models.llama import Linear

    layer = Linear(hidden_size, intermediate_size, bias=False).to(dtype)
    total = 0.0
    for n in rows:
        x = torch.randn(n, hidden_size, dtype=dtype)
        layer(x)  # first call: oneDNN picks and caches its kernel
        total += min(_timed(layer, x) for _ in range(reps))
    return total


def _timed(layer, x) -> float:
    start = time.perf_counter()
    layer(x)
    return time.perf_counter() - start
