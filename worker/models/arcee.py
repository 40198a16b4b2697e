"""Arcee's AFM (ArceeForCausalLM: AFM-4.5B) on the Llama family's layer, attention, linears and paged
cache, with what AFM does differently, as transformers computes it: a non-gated MLP, up, then ReLU²
(relu(x)²), then down — no gate. `UngatedMLP` is StarCoder 2's MLP too (GELU-tanh; starcoder2.py).

On CPU in fp32 the native kernels run the layer as Llama's (norms fused with the residual adds, q/k/v,
rope, attention); the MLP's activation is torch's.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from worker.engine.cpu_native import CpuKernels
from worker.models.config import ModelConfig
from worker.models.linear import Linear
from worker.models.llama import CausalLM, DecoderLayer
from worker.models.parallel import ColumnParallelLinear, RowParallelLinear, Shard


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


class UngatedMLP(nn.Module):
    """up_proj, the activation, down_proj (biased where mlp_bias); under tensor parallelism up's
    rows and down's columns split, as a gated MLP's."""

    def __init__(self, cfg: ModelConfig, shard: Shard, act: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        inter, self.act_fn = cfg.intermediate_size, act  # a module (xIELU) keeps its parameters under this name
        if shard.size == 1:
            self.up_proj = Linear(cfg.hidden_size, inter, bias=cfg.mlp_bias)
            self.down_proj = Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)
            return
        first, n = shard.split(inter, "intermediate size")
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, [("up_proj", first, n)], cfg.mlp_bias)
        self.down_proj = RowParallelLinear(first, n, cfg.hidden_size, cfg.mlp_bias, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))

    def forward_fused(self, x: torch.Tensor, ops: CpuKernels) -> torch.Tensor:
        return self.forward(x)


class ArceeDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, backend, shard: Shard, index: int):
        super().__init__(cfg, backend, shard, index)
        self.mlp = UngatedMLP(cfg, shard, relu_squared)  # in place of Llama's gated one


class ArceeCausalLM(CausalLM):
    layer_class = ArceeDecoderLayer
