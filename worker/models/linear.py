"""The one matmul every linear layer of the model runs, sharded or not, and the CPU GEMM paths it
can take (gemm_probe.py chooses among them per CPU, by timing them at load)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.engine import cpu_native

_ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN over a plain weight or over one `pack`ed at load."""
    if _ONEDNN_LINEAR is not None and x.device.type == "cpu" and x.dtype == torch.float32:
        return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


PACK_ROWS = 64  # the row count oneDNN tunes a packed layout for (8, 64 and 256 ran alike; 1 slower)


def can_pack() -> bool:
    return _ONEDNN_LINEAR is not None and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's own blocked layout, made once at load (any row count runs on it),
    instead of the plain layout its kernels otherwise work from in every call. Only fp32 CPU
    weights are packed; others stay as they are."""
    if weight.is_mkldnn or weight.device.type != "cpu" or weight.dtype != torch.float32 or not can_pack():
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


def _native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Our own GEMM (cpu_native.gemm) over a weight in panels; a weight left as it is (not fp32 on
    CPU, or tied to the embedding) goes to torch's."""
    if weight.dim() == 3 and x.dtype == torch.float32 and x.device.type == "cpu":
        return cpu_native.gemm(x, weight, weight.n_out, bias)
    return F.linear(x, weight, bias)


def can_panel() -> bool:
    """The native GEMM is built in this process (with the engine's native fp32 CPU kernels)."""
    return cpu_native.panel_width() is not None


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / NR), in, NR] (zero-padded): the native GEMM's layout, NR output
    columns side by side per input column, NR fixed by this CPU's vector width. Only fp32 CPU
    weights are laid out so, and only where the native GEMM is built; others stay as they are.
    The result's `n_out` is the real output width (relay keeps it on the parameter)."""
    width = cpu_native.panel_width()
    if width is None or weight.is_mkldnn or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return weight
    out, inp = weight.shape
    padded = F.pad(weight.detach(), (0, 0, 0, -out % width))
    panels = padded.view(-1, width, inp).transpose(1, 2).contiguous()
    panels.n_out = out
    return panels


def from_panels(panels: torch.Tensor) -> torch.Tensor:
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:panels.n_out].contiguous()


# Weight layouts: row-major [out, in]; "cols", [in, out] memory seen as [out, in]; "packed", oneDNN's
# own blocked format (an opaque mkldnn tensor, which only oneDNN reads); "panels", the native GEMM's.
ROWS, COLS, PACKED, PANELS = "rows", "cols", "packed", "panels"
# name -> (function, the weight layout it reads). Which is fastest flips between CPU families and
# batch sizes (a 1-row GEMV over a row-major weight ran 4x slower than over a transposed one on AMD;
# on an Intel Xeon a packed weight made decode steps 1.2-1.4x faster than MKL's at 8 to 64
# sequences, and 0.8x at 1; the native GEMM's pass over a decode step's weights was 1.2x oneDNN's
# packed one at 51 rows there, 1.6x at 8 and 1.5x at 1).
PATHS: dict[str, tuple[Callable, str]] = {
    "onednn": (_onednn, ROWS), "aten": (F.linear, ROWS),
    "onednn_t": (_onednn, COLS), "aten_t": (F.linear, COLS),
    "onednn_p": (_onednn, PACKED), "native": (_native, PANELS),
}
SMALL_ROWS = 16  # at most this many rows is a "small" GEMM (decode of a few sequences)


@dataclass(frozen=True)
class LinearKernel:
    """Which path a GEMM of few rows and one of many take; both in the one weight layout."""

    small: str = "onednn"
    large: str = "onednn"

    def __post_init__(self):
        for name in (self.small, self.large):
            if name not in PATHS:
                raise ValueError(f"unknown linear kernel {name!r}: auto, {', '.join(PATHS)}")
        if PATHS[self.small][1] != PATHS[self.large][1]:
            raise ValueError("both sizes must share one weight layout")

    @property
    def layout(self) -> str:
        return PATHS[self.small][1]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return PATHS[self.small if rows <= SMALL_ROWS else self.large][0](x, weight, bias)


DEFAULT = LinearKernel()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The default path (oneDNN for fp32 on CPU): what a layer runs before any choice is made."""
    return DEFAULT(x, weight, bias)


class Linear(nn.Linear):
    kernel: LinearKernel = DEFAULT

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias)


def plain(weight: torch.Tensor) -> torch.Tensor:
    """The [out, in] values, whatever the layout (a row-major or transposed weight as it is)."""
    if weight.is_mkldnn:
        return weight.to_dense()
    return from_panels(weight) if weight.dim() == 3 else weight


def lay_out(weight: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values in `layout` (a weight that cannot be packed stays as it is)."""
    weight = plain(weight)
    if layout == PACKED:
        return pack(weight)
    if layout == PANELS:
        return to_panels(weight)
    if layout == COLS:
        return weight.detach().t().contiguous().t()
    return weight.detach().contiguous()


def use_kernel(model: nn.Module, kernel: LinearKernel) -> None:
    """Every Linear of the model takes `kernel`, its weight re-laid to the kernel's layout."""
    tied = tied_weights(model)
    for module in model.modules():
        if isinstance(module, Linear):
            module.kernel = kernel
            relay(module, kernel.layout, tied)


def tied_weights(model: nn.Module) -> set[int]:
    """ids of weights an embedding shares: they keep their layout (the lookup reads rows)."""
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def relay(module: Linear, layout: str, tied: frozenset[int] | set[int] = frozenset()) -> None:
    """The module's weight in `layout`, values unchanged (a tied weight keeps its own)."""
    w = module.weight
    if id(w) not in tied and layout_of(w) != layout:
        laid = lay_out(w, layout)
        module.weight = nn.Parameter(laid, requires_grad=False)
        if laid.dim() == 3:
            module.weight.n_out = laid.n_out


def layout_of(w: torch.Tensor) -> str:
    if w.is_mkldnn:
        return PACKED
    if w.dim() == 3:
        return PANELS
    return COLS if w.dim() == 2 and w.stride() == (1, w.shape[0]) and w.shape[0] > 1 else ROWS
