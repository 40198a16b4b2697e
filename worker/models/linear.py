"""The one matmul every linear layer of the model runs, sharded or not."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 on CPU runs oneDNN's GEMM: torch's default there (MKL) reaches about half of what
    oneDNN does on AMD cores, at every batch size from decode to prefill."""
    if _ONEDNN_LINEAR is not None and x.device.type == "cpu" and x.dtype == torch.float32:
        return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
