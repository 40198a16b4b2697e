"""Cohere's Command R (CohereForCausalLM; Command R+ with q/k norms) and Command R7B (Cohere2ForCausalLM)
on the Llama family's attention, MLP, linears and paged cache, with what Cohere does differently, each
as transformers computes it:

- one LayerNorm a layer (a weight, no bias; in fp32), whose output feeds the attention and the MLP
  side by side, both added to the residual; a LayerNorm at the end too;
- logits x logit_scale; the head tied to the embeddings;
- RoPE turns each head's adjacent pairs of values (llama.py's rotate_pairs_as_halves reorders q and k
  once loaded, their per-head norms' weights with them);
- Command R+ (use_qk_norm): q and k LayerNormed per head, each head with its own weights;
- Command R7B: three sliding layers to one full, only the sliding ones rotated (the full ones have
  no position encoding).

It runs the torch path on every device (the native fused kernels compute RMSNorms after Llama's
residual adds); attention still goes through the backend, the native decode kernel included.
"""
from __future__ import annotations

import torch
from torch import nn

from worker.models.config import ModelConfig
from worker.models.llama import MLP, Attention, CausalLM
from worker.models.parallel import Piece, Shard


class CohereLayerNorm(nn.Module):
    """LayerNorm over the last dimension, without bias, in fp32; `shape` (dim,), or (heads, head_dim)
    for q and k, each head with its own weight."""

    def __init__(self, shape: int | tuple[int, int], eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        mean = x.mean(-1, keepdim=True)
        x = (x - mean) * torch.rsqrt((x - mean).pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(torch.float32) * x).to(dtype)


class HeadNorm(CohereLayerNorm):
    """Command R+'s q or k norm over this rank's heads: rows [first, first + heads) of the checkpoint's."""

    def __init__(self, first: int, heads: int, head_dim: int, eps: float):
        super().__init__((heads, head_dim), eps)
        self.first = first

    def pieces(self, prefix: str, param: str) -> list[Piece]:
        return [Piece(f"{prefix}.{param}", 0, self.first, self.first + self.weight.shape[0])]


class CohereDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, shard: Shard, index: int):
        super().__init__()
        self.local_rope = False
        self.input_layernorm = CohereLayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        rope = cfg.rope_layers is None or cfg.rope_layers[index]
        self.self_attn = Attention(cfg, backend, shard, cfg.layer_windows[index], rope)
        if cfg.qk_norm:  # in place of the per-head norms Attention builds, which share one weight
            attn, kv_first = self.self_attn, shard.kv_heads(cfg.num_heads, cfg.num_kv_heads)[0]
            attn.q_norm = HeadNorm(attn.q_first, attn.num_heads, cfg.head_dim, cfg.rms_norm_eps)
            attn.k_norm = HeadNorm(kv_first, attn.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard)

    def forward(self, h, rope, kv_cache, meta):
        x = self.input_layernorm(h)
        return h + self.self_attn(x, rope, kv_cache, meta) + self.mlp(x)


class CohereCausalLM(CausalLM):
    layer_class, norm_class = CohereDecoderLayer, CohereLayerNorm
    fuses_on_cpu = False

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.cfg.logit_scale
