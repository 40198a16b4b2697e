"""StableLM 2 (StableLmForCausalLM: StableLM 2 1.6B and 12B, Zephyr) on the Llama family's attention, MLP,
linears and paged cache, with what StableLM does differently, each as transformers computes it:

- LayerNorms with a weight and a bias (epsilon layer_norm_eps) before the branches and at the end;
- RoPE over the first partial_rotary_factor of each head (a quarter unless said);
- q/k/v biased where use_qkv_bias (o and the MLP never);
- where qk_layernorm (12B): q and k LayerNormed per head, each head with a weight of its own and no bias;
- where use_parallel_residual (12B): one norm a layer, whose output feeds the attention and the MLP
  side by side, both added to the residual (Command R's layer); else Llama's two.

It runs the torch path on every device (the native fused kernels compute RMSNorms after Llama's
residual adds); attention still goes through the backend, the native decode kernel included.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.config import ModelConfig
from worker.models.llama import MLP, Attention, CausalLM
from worker.models.parallel import Piece, Shard


class HeadLayerNorm(nn.Module):
    """q's or k's LayerNorm over this rank's heads, each head's own weight: the checkpoint's
    `<name>.norms.<h>.weight` for h in [first, first + heads), held end to end."""

    def __init__(self, name: str, first: int, heads: int, head_dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads * head_dim))
        self.name, self.first, self.heads, self.eps = name, first, heads, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.weight.view(self.heads, -1)
        return torch.stack([F.layer_norm(x[:, h], weights.shape[1:], weights[h], None, self.eps)
                            for h in range(self.heads)], dim=1)

    def pieces(self, prefix: str, param: str) -> list[Piece]:
        attention = prefix.rpartition(".")[0]
        return [Piece(f"{attention}.{self.name}.norms.{h}.{param}") for h in range(self.first, self.first + self.heads)]


class StableLmDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, shard: Shard, index: int):
        super().__init__()
        self.local_rope = False
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend, shard, cfg.layer_windows[index])
        if cfg.qk_norm:  # in place of the RMSNorms Attention builds, which share one weight across heads
            attn, kv_first = self.self_attn, shard.kv_heads(cfg.num_heads, cfg.num_kv_heads)[0]
            attn.q_norm = HeadLayerNorm("q_layernorm", attn.q_first, attn.num_heads, cfg.head_dim, cfg.rms_norm_eps)
            attn.k_norm = HeadLayerNorm("k_layernorm", kv_first, attn.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)
        self.post_attention_layernorm = (None if cfg.parallel_residual
                                         else nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps))
        self.mlp = MLP(cfg, shard)

    def forward(self, h, rope, kv_cache, meta):
        x = self.input_layernorm(h)
        attn = self.self_attn(x, rope, kv_cache, meta)
        if self.post_attention_layernorm is None:  # use_parallel_residual
            return h + attn + self.mlp(x)
        h = h + attn
        return h + self.mlp(self.post_attention_layernorm(h))


class StableLmCausalLM(CausalLM):
    layer_class, norm_class = StableLmDecoderLayer, nn.LayerNorm
    fuses_on_cpu = False
