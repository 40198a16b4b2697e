"""Chooses the CPU GEMM path of the model's linear layers by timing the alternatives at load.

oneDNN vs MKL, and a row-major vs a transposed weight, flip between CPU families and batch sizes
(oneDNN ran at twice MKL's rate on AMD EPYC at 64 rows; a 1-row GEMV was 4x faster on a transposed
weight), so each is timed once per process on the model's own shapes, at a few rows and at the
decode batch, interleaved and best-of-reps (a loaded host slows all alike), within a time budget.
An alternative that raises is simply not chosen.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from worker.models.linear import PATHS, SMALL_ROWS, Linear, LinearKernel

log = logging.getLogger("kvgate.worker")

BUDGET_S = 0.3  # measured repetitions stop once this is spent (the first always runs in full)
REPS = 4
MAX_OUT = 8192  # a vocabulary-sized weight is timed on this many of its rows (linear in rows)


@dataclass(frozen=True)
class KernelChoice:
    kernel: LinearKernel
    source: str  # "probe", "forced" or why there was no probe
    timings_ms: dict = field(default_factory=dict)  # "path@rows": ms over the model's linears

    def label(self) -> str:
        k = self.kernel
        return k.small if k.small == k.large else f"{k.small}<={SMALL_ROWS}<{k.large}"


def choose(model: nn.Module, setting: str, device: torch.device, dtype: torch.dtype,
           decode_rows: int) -> KernelChoice:
    """`setting`: auto, or one of PATHS (forced, for both sizes). The probe runs for fp32 on CPU."""
    if setting != "auto":
        return KernelChoice(LinearKernel(setting, setting), "forced")
    if device.type != "cpu" or dtype != torch.float32:
        return KernelChoice(LinearKernel("aten", "aten"), f"no probe: {device.type} {dtype}")
    shapes = _shapes(model)
    timings = _probe(tuple(sorted(shapes.items())), (min(4, SMALL_ROWS), max(decode_rows, SMALL_ROWS + 1)),
                     torch.get_num_threads())
    return KernelChoice(_pick(timings), "probe", timings)


def _shapes(model: nn.Module) -> dict[tuple[int, int, bool], int]:
    """(out, in, bias) -> how many Linear layers have it."""
    counts: dict[tuple[int, int, bool], int] = {}
    for m in model.modules():
        if isinstance(m, Linear):
            key = (m.out_features, m.in_features, m.bias is not None)
            counts[key] = counts.get(key, 0) + 1
    return counts


@functools.cache
def _probe(shapes: tuple, rows: tuple[int, int], threads: int) -> dict[str, float]:
    """ms per forward over every linear, per path and row count; a path that raised is absent."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for (out, inp, bias), count in shapes:
        scale = count * out / min(out, MAX_OUT)
        w = torch.randn(min(out, MAX_OUT), inp, generator=gen)
        layouts = {False: w, True: w.t().contiguous().t()}
        b = torch.randn(w.shape[0], generator=gen) if bias else None
        cases.append((layouts, b, scale, inp))
    xs = {n: {inp: torch.randn(n, inp, generator=gen) for *_, inp in cases} for n in rows}
    best: dict[str, float] = {}
    usable = [name for name in PATHS if _works(name, cases, xs[rows[0]])]
    start = time.perf_counter()
    with torch.inference_mode():
        for rep in range(REPS):
            if rep and time.perf_counter() - start > BUDGET_S:
                break
            for name in usable:
                fn, transposed = PATHS[name]
                for n in rows:
                    total = sum(scale * _timed(fn, xs[n][inp], layouts[transposed], b)
                                for layouts, b, scale, inp in cases)
                    best[f"{name}@{n}"] = min(best.get(f"{name}@{n}", float("inf")), 1e3 * total)
    return best


def _works(name: str, cases: list, xs: dict) -> bool:
    """One call per shape, untimed: oneDNN builds its primitives here; a path that raises is out."""
    fn, transposed = PATHS[name]
    try:
        with torch.inference_mode():
            for layouts, b, _, inp in cases:
                fn(xs[inp], layouts[transposed], b)
    except Exception as exc:  # not on this CPU or build: never chosen
        log.info("linear kernel %s unavailable: %s", name, exc)
        return False
    return True


def _timed(fn, x, w, b) -> float:
    start = time.perf_counter()
    fn(x, w, b)
    return time.perf_counter() - start


def _pick(timings: dict[str, float]) -> LinearKernel:
    """The layout whose best paths cost least, each size counted against its own fastest (so the
    decode batch's larger times do not drown the few-row case); then each size's faster path."""
    if not timings:
        return LinearKernel("aten", "aten")
    small, large = sorted({int(k.split("@")[1]) for k in timings})

    def fastest(rows: int, transposed: bool) -> tuple[float, str]:
        found = [(t, k.split("@")[0]) for k, t in timings.items()
                 if int(k.split("@")[1]) == rows and PATHS[k.split("@")[0]][1] == transposed]
        return min(found, default=(float("inf"), ""))

    floor = {n: min(t for k, t in timings.items() if k.endswith(f"@{n}")) for n in (small, large)}
    cost = {tr: fastest(small, tr)[0] / floor[small] + fastest(large, tr)[0] / floor[large] for tr in (False, True)}
    transposed = min(cost, key=cost.get)
    return LinearKernel(fastest(small, transposed)[1], fastest(large, transposed)[1])
