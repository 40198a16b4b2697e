"""The one matmul every linear layer of the model runs, sharded or not, and the CPU GEMM paths it
can take (gemm_probe.py chooses among them per CPU, by timing them at load)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if _ONEDNN_LINEAR is not None and x.device.type == "cpu" and x.dtype == torch.float32:
        return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


# name -> (function, whether the weight is stored transposed: [in, out] memory seen as [out, in]).
# oneDNN and MKL (aten) each come in both layouts: which is fastest flips between CPU families and
# batch sizes (a 1-row GEMV over a row-major weight ran 4x slower than over a transposed one on AMD).
PATHS: dict[str, tuple[Callable, bool]] = {
    "onednn": (_onednn, False), "aten": (F.linear, False),
    "onednn_t": (_onednn, True), "aten_t": (F.linear, True),
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
    def transposed(self) -> bool:
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


def use_kernel(model: nn.Module, kernel: LinearKernel) -> None:
    """Every Linear of the model takes `kernel`, its weight re-laid to the kernel's layout (values
    unchanged; a weight tied to the embedding keeps its layout: the lookup reads rows)."""
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        module.kernel = kernel
        w = module.weight
        if id(w) in tied or _is_transposed(w) == kernel.transposed:
            continue
        data = w.detach().t().contiguous().t() if kernel.transposed else w.detach().contiguous()
        module.weight = nn.Parameter(data, requires_grad=False)


def _is_transposed(w: torch.Tensor) -> bool:
    return w.dim() == 2 and w.stride() == (1, w.shape[0]) and w.shape[0] > 1
