"""Apertus (ApertusForCausalLM: Apertus-8B and 70B) on the Llama family's layer, attention, linears and
paged cache, with what Apertus does differently, as transformers computes it:

- a non-gated MLP, up, xIELU, down (arcee.py's UngatedMLP), xIELU with two learned scalars a layer:
  x > 0: softplus(alpha_p) x² + beta x; else (expm1(min(x, eps)) - x)(beta + softplus(alpha_n)) + beta x,
  beta 0.5 and eps -1e-6 in the model's dtype (transformers' defaults; its buffers hold no more);
- q and k RMS-normed per head before RoPE (Qwen3's), under the checkpoint's names; the norms before the
  branches named attention_layernorm and feedforward_layernorm;
- where its config says nothing, Llama 3's RoPE scaling on a base of 12,000,000 (config.py reads it so).

On CPU in fp32 the native kernels run the layer as Llama's; xIELU is torch's.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.arcee import UngatedMLP
from worker.models.config import ModelConfig
from worker.models.llama import CausalLM, DecoderLayer
from worker.models.parallel import Piece, Shard

_NAMES = ((".input_layernorm.", ".attention_layernorm."), (".post_attention_layernorm.", ".feedforward_layernorm."))


class XIELU(nn.Module):
    """xIELU (arXiv 2411.13010), in transformers' Python form: its alpha_p and alpha_n (each [1]) are
    read from the checkpoint, softplus'd here; every rank holds them whole."""

    def __init__(self):
        super().__init__()
        self.alpha_p, self.alpha_n = nn.Parameter(torch.empty(1)), nn.Parameter(torch.empty(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        beta, eps = torch.tensor(0.5, dtype=x.dtype), torch.tensor(-1e-6, dtype=x.dtype)
        alpha_p, alpha_n = F.softplus(self.alpha_p), beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + beta * x, (torch.expm1(torch.min(x, eps)) - x) * alpha_n + beta * x)


class ApertusDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, backend, shard: Shard, index: int):
        super().__init__(cfg, backend, shard, index)
        self.mlp = UngatedMLP(cfg, shard, XIELU())  # in place of Llama's gated one


class ApertusCausalLM(CausalLM):
    layer_class = ApertusDecoderLayer

    def checkpoint_pieces(self, name: str) -> list[Piece]:
        pieces = super().checkpoint_pieces(name)
        for ours, theirs in _NAMES:
            pieces = [replace(p, name=p.name.replace(ours, theirs)) for p in pieces]
        return pieces
