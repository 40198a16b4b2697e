"""Chooses the CPU GEMM path of the model's linear layers by timing the alternatives at load.

oneDNN vs MKL vs our own (cpu_native.py), and a row-major, a transposed, a oneDNN-packed or a
paneled weight, flip between CPU families and batch sizes (oneDNN ran at twice MKL's rate on AMD
EPYC at 64 rows; a 1-row GEMV was 4x faster on a transposed weight; on an Intel Xeon a packed
weight ran 1.3x the others at 4 to 16 rows), so each is timed once per process on the model's own
weights, at a few rows and at the decode batch.

The timing is of what a decode step does: one pass over the linears in the order the step runs
them, each reading its own weight from memory. Timing one layer's weight over and over measured
caches, not the step: on the Xeon it ranked the paths at 4 rows in the opposite order (MKL over
a transposed weight 1.8x ahead of a packed one, which is 1.3x ahead in the pass). The model's weights
are re-laid in place for each layout in turn (no second copy), the layouts taken in rounds and the
paths of a layout interleaved, best of the rounds (a loaded host slows all alike), within a time
budget. An alternative that raises is simply not chosen.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from worker.models.linear import (PACKED, PANELS, PATHS, SMALL_ROWS, Linear, LinearKernel, can_pack, can_panel, relay,
                                  tied_weights)

log = logging.getLogger("kvgate.worker")

BUDGET_S = 1.0  # no round after the second starts once this is spent
ROUNDS, MIN_ROUNDS = 3, 2
MAX_BYTES = 256 << 20  # a bigger model is timed on its first linears up to this size (beyond the caches)
_TIMINGS: dict[tuple, dict[str, float]] = {}  # one probe per process per shape sequence and rows


@dataclass(frozen=True)
class KernelChoice:
    kernel: LinearKernel
    source: str  # "probe", "forced" or why there was no probe
    timings_ms: dict = field(default_factory=dict)  # "path@rows": ms of a pass over the probed linears

    def label(self) -> str:
        k = self.kernel
        return k.small if k.small == k.large else f"{k.small}<={SMALL_ROWS}<{k.large}"


def choose(model: nn.Module, setting: str, device: torch.device, dtype: torch.dtype,
           decode_rows: int) -> KernelChoice:
    """`setting`: auto, or one of PATHS (forced, for both sizes). The probe runs for fp32 on CPU;
    it leaves the weights in whichever layout it timed last (use_kernel lays them out for the choice)."""
    if setting != "auto":
        return KernelChoice(LinearKernel(setting, setting), "forced")
    if device.type != "cpu" or dtype != torch.float32:
        return KernelChoice(LinearKernel("aten", "aten"), f"no probe: {device.type} {dtype}")
    tied = tied_weights(model)
    linears = probed(model, tied)
    rows = (min(4, SMALL_ROWS), max(decode_rows, SMALL_ROWS + 1))
    key = (tuple((m.out_features, m.in_features, m.bias is not None) for m in linears), rows,
           torch.get_num_threads())
    if key not in _TIMINGS:
        _TIMINGS[key] = probe(linears, rows)
    return KernelChoice(_pick(_TIMINGS[key]), "probe", _TIMINGS[key])


def probed(model: nn.Module, tied: set[int]) -> list[Linear]:
    """The linears in the order a step runs them, up to MAX_BYTES of weights; not one whose weight
    the embedding shares (it keeps its layout whatever is chosen, and a tied lm_head of a large
    vocabulary would take most of each pass: 622 MB of Qwen3-0.6B's 2.4 GB in fp32)."""
    chosen, size = [], 0
    for m in model.modules():
        if isinstance(m, Linear) and id(m.weight) not in tied and size < MAX_BYTES:
            chosen.append(m)
            size += m.weight.numel() * m.weight.element_size()
    return chosen


def probe(linears: list[Linear], rows: tuple[int, int]) -> dict[str, float]:
    """ms per pass over `linears` with their own weights, per path and row count; a path that
    raised (or a layout this build cannot make) is absent."""
    gen = torch.Generator().manual_seed(0)
    widths = {m.in_features for m in linears}
    xs = {n: {w: torch.randn(n, w, generator=gen) for w in widths} for n in rows}
    layouts = {lay: [n for n, (_, l) in PATHS.items() if l == lay] for _, lay in PATHS.values()}
    if not can_pack():
        layouts.pop(PACKED)
    if not can_panel():
        layouts.pop(PANELS)
    best: dict[str, float] = {}
    start = time.perf_counter()
    with torch.inference_mode():
        for rnd in range(ROUNDS):
            if rnd >= MIN_ROUNDS and time.perf_counter() - start > BUDGET_S:
                break
            for layout, names in layouts.items():
                for m in linears:
                    relay(m, layout)
                if not rnd:  # the warm-up: oneDNN builds its primitives here, for both sizes
                    names[:] = [n for n in names if _works(n, linears, xs)]
                for name in names:
                    for n in rows:
                        best[f"{name}@{n}"] = min(best.get(f"{name}@{n}", float("inf")),
                                                  1e3 * _pass(PATHS[name][0], linears, xs[n]))
    return best


def _works(name: str, linears: list[Linear], xs: dict) -> bool:
    """One untimed pass at each size; a path that raises is out."""
    try:
        for x in xs.values():
            _pass(PATHS[name][0], linears, x)
    except Exception as exc:  # not on this CPU or build: never chosen
        log.info("linear kernel %s unavailable: %s", name, exc)
        return False
    return True


def _pass(fn, linears: list[Linear], xs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for m in linears:
        fn(xs[m.in_features], m.weight, m.bias)
    return time.perf_counter() - start


def _pick(timings: dict[str, float]) -> LinearKernel:
    """The layout whose best paths cost least, each size counted against its own fastest (so the
    decode batch's larger times do not drown the few-row case); then each size's faster path."""
    if not timings:
        return LinearKernel("aten", "aten")
    small, large = sorted({int(k.split("@")[1]) for k in timings})

    def fastest(rows: int, layout: str) -> tuple[float, str]:
        found = [(t, k.split("@")[0]) for k, t in timings.items()
                 if int(k.split("@")[1]) == rows and PATHS[k.split("@")[0]][1] == layout]
        return min(found, default=(float("inf"), ""))

    floor = {n: min(t for k, t in timings.items() if k.endswith(f"@{n}")) for n in (small, large)}
    layouts = dict.fromkeys(layout for _, layout in PATHS.values())  # in PATHS' order: a tie keeps the first
    cost = {lay: fastest(small, lay)[0] / floor[small] + fastest(large, lay)[0] / floor[large] for lay in layouts}
    layout = min(cost, key=cost.get)
    return LinearKernel(fastest(small, layout)[1], fastest(large, layout)[1])
