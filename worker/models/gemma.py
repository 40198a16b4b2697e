"""Gemma 3 text models (Gemma3ForCausalLM: gemma-3-270m, gemma-3-1b), Gemma 2 and Gemma 1 on the Llama
family's attention, linears and paged cache, with what Gemma does differently, each as transformers'
Gemma3, Gemma2 and Gemma compute it:

- RMSNorm scales by (1 + w), in fp32, cast after (the checkpoint stores w around 0);
- Gemma 2 and 3: four norms a layer, the attention's and the MLP's outputs normed before their
  residual adds (Gemma 1: Llama's two, before each branch);
- the embeddings are multiplied by sqrt(hidden_size); the MLP is GELU (tanh) x up;
- q/k RMSNorm per head (Gemma 3); the scores scaled by query_pre_attn_scalar^-0.5;
- sliding layers (Gemma 3: five of six) attend a window with their own RoPE base (10,000), the full
  ones with rope_theta (1,000,000, linearly scaled in the larger models); Gemma 2's every other
  layer, one RoPE for all;
- Gemma 2's attention scores soft-capped (cap * tanh(score / cap), in every attention backend);
- logits soft-capped where the config says so.

It runs the torch path on every device (the native CPU kernels fuse Llama's norm order, not this
one); attention still goes through the backend, the native decode kernel included.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.config import ModelConfig
from worker.models.llama import MLP, Attention, CausalLM
from worker.models.parallel import Shard


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class GemmaMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, shard: Shard, index: int):
        super().__init__()
        self.local_rope = cfg.local_rope(index)
        self.sandwich = cfg.arch != "gemma"  # Gemma 2 and 3 norm each branch's output too
        norm = lambda dim: GemmaRMSNorm(dim, cfg.rms_norm_eps)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(cfg.hidden_size), norm(cfg.hidden_size)
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(cfg.hidden_size)
            self.post_feedforward_layernorm = norm(cfg.hidden_size)
        self.self_attn = Attention(cfg, backend, shard, cfg.layer_windows[index], norm=GemmaRMSNorm)
        if cfg.query_pre_attn_scalar is not None:  # Gemma 1's scores: head_dim^-0.5, Llama's
            self.self_attn.scale = cfg.query_pre_attn_scalar ** -0.5
        self.self_attn.softcap = cfg.attn_softcap
        self.mlp = GemmaMLP(cfg, shard)

    def forward(self, h, rope, kv_cache, meta):
        if not self.sandwich:  # Gemma 1: post_attention_layernorm is the MLP's input norm, as in Llama
            h = h + self.self_attn(self.input_layernorm(h), rope, kv_cache, meta)
            return h + self.mlp(self.post_attention_layernorm(h))
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), rope, kv_cache, meta))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaCausalLM(CausalLM):
    layer_class, norm_class = GemmaDecoderLayer, GemmaRMSNorm

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        h = h * torch.tensor(self.cfg.hidden_size ** 0.5).to(h.dtype)
        ropes = self._ropes(positions, h.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h = layer(h, ropes[layer.local_rope], kv_cache, meta)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.cfg.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
