"""DeepSeek-V2 and V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM) on the Llama family's layer, MLP,
experts (moe.py: V3 routed as GLM-4.5, V2 by its own rule), linears and paged cache, with multi-head
latent attention (MLA) in place of q/k/v, computed as transformers' eager path computes it:

- q from q_proj, or through a low-rank bottleneck: q_a_proj, RMS-normed, q_b_proj (`q_lora_rank`);
- one latent a row, kv_a_proj_with_mqa -> (latent, k_pe): the latent RMS-normed, then kv_b_proj gives
  each head its k_nope and its v; k_pe, rotated, is shared by every head: k = [k_nope, k_pe];
- RoPE over each q head's last qk_rope_head_dim values and over k_pe, by adjacent pairs (V2; V3 where
  rope_interleave): q's and k_pe's rows reordered once loaded (`rotate_pairs_as_halves`), as GLM's;
- scores scaled by qk_head_dim^-0.5, x mscale^2 under YaRN with mscale_all_dim (`softmax_scale`).

K's heads (qk_head_dim) and V's (v_head_dim) differ in width; the paged cache holds one head size,
the wider (config.py's head_dim), the narrower zero-padded to it — zeros add nothing to a score or an
output — so every attention path (native, torch, Triton) runs unchanged, and each head's output is
cut back to v_head_dim before o_proj. The cache holds every head's K and V, not the latent: what MLA
saves in cache memory is not saved here.

Under tensor parallelism the heads split: q_proj / q_b_proj, kv_b_proj and o_proj by heads, the
latent's projections and norms whole on each rank.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from worker.engine.attention import AttentionMetadata
from worker.engine.cpu_native import CpuKernels
from worker.models.config import ModelConfig
from worker.models.linear import Linear
from worker.models.llama import CausalLM, DecoderLayer, RMSNorm, Rope, _rotary
from worker.models.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, Shard

LATENT_NORM_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's: transformers' default, not rms_norm_eps


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim^-0.5, x mscale^2 (mscale = 0.1 mscale_all_dim ln(factor) + 1) where a scaled RoPE says
    mscale_all_dim: transformers' yarn_apply_mscale, which scales the unrotated values' scores too."""
    scale, scaling = cfg.mla.qk_head_dim ** -0.5, cfg.rope_scaling or {}
    m_all, factor = scaling.get("mscale_all_dim"), scaling.get("factor", 1.0)
    if m_all and factor > 1:
        mscale = 0.1 * m_all * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def _columns(in_features: int, name: str, first: int, rows: int, shard: Shard) -> Linear:
    """A bias-free linear of `rows` outputs: whole at N = 1, else this rank's rows from `first`."""
    if shard.size == 1:
        return Linear(in_features, rows, bias=False)
    return ColumnParallelLinear(in_features, [(name, first, rows)], False)


class LatentAttention(nn.Module):
    """This rank's heads of DeepSeek's MLA; `window` and `rope` are DecoderLayer's arguments, which MLA
    has no use for (no sliding layers, every layer rotated)."""

    def __init__(self, cfg: ModelConfig, backend, shard: Shard = SINGLE, window: int | None = None,
                 rope: bool = True):
        super().__init__()
        mla, hidden = cfg.mla, cfg.hidden_size
        first, self.num_heads = shard.split(cfg.num_heads, "attention heads")
        self.nope, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.qk_dim, self.head_dim, self.latent = mla.qk_head_dim, cfg.head_dim, mla.kv_lora_rank
        q_first, q_rows = first * self.qk_dim, self.num_heads * self.qk_dim
        self.q_lora = mla.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = _columns(mla.q_lora_rank, "q_b_proj", q_first, q_rows, shard)
        else:
            self.q_proj = _columns(hidden, "q_proj", q_first, q_rows, shard)
        self.kv_a_proj_with_mqa = Linear(hidden, self.latent + self.rope_dim, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.latent, LATENT_NORM_EPS)
        kv = self.nope + self.v_dim
        self.kv_b_proj = _columns(self.latent, "kv_b_proj", first * kv, self.num_heads * kv, shard)
        v_size = self.num_heads * self.v_dim
        self.o_proj = (Linear(v_size, hidden, bias=cfg.o_bias) if shard.size == 1
                       else RowParallelLinear(first * self.v_dim, v_size, hidden, cfg.o_bias, shard))
        self.scale, self.backend = softmax_scale(cfg), backend

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        q = self._queries(x).view(-1, self.num_heads, self.qk_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(-1, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_pe = _rotary(k_pe.unsqueeze(1), rope.cos, rope.sin).expand(-1, self.num_heads, -1)
        q = torch.cat((q_nope, _rotary(q_pe, rope.cos, rope.sin)), dim=-1)
        k = torch.cat((k_nope, k_pe), dim=-1)
        q, k, v = (self._padded(t) for t in (q, k, v))
        k_cache, v_cache = kv_cache
        self.backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = self.backend.attend(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out[..., :self.v_dim].reshape(-1, self.num_heads * self.v_dim))

    def forward_fused(self, x: torch.Tensor, positions: torch.Tensor, rope_table: torch.Tensor,
                      kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                      ops: CpuKernels, q_scale: torch.Tensor | None = None) -> torch.Tensor:
        """forward, its rows' cos and sin looked up in the table (the native kernels' in-place rope
        turns each head's first values, not the last ones MLA rotates)."""
        rows = rope_table.index_select(0, positions)
        return self.forward(x, Rope(rows[:, :1], rows[:, 1:]), kv_cache, meta)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)

    def _padded(self, t: torch.Tensor) -> torch.Tensor:
        """Heads zero-padded to the cache's head size (V's, or q's and k's, whichever is narrower)."""
        return t if t.shape[-1] == self.head_dim else F.pad(t, (0, self.head_dim - t.shape[-1]))

    def rotate_pairs_as_halves(self, rotary_dim: int) -> None:
        """Once loaded: DeepSeek's RoPE turns the rotated part's values 2i and 2i + 1 together, ours i
        and i + rotary_dim / 2. With the rows that make each q head's rotated part and k_pe reordered
        (the even ones, then the odd ones) ours turns the same pairs by the same angles; a score, q's
        head dotted with k's, is the same sum under one reordering of both (llama.py's, for GLM)."""
        pairs = torch.cat((torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)))
        heads = torch.arange(0, self.num_heads * self.qk_dim, self.qk_dim).unsqueeze(1) + self.nope
        q_rows = ((heads + torch.arange(rotary_dim)).flatten(), (heads + pairs).flatten())  # (to, from)
        k_rows = (self.latent + torch.arange(rotary_dim), self.latent + pairs)
        q_proj = self.q_b_proj if self.q_lora else self.q_proj
        with torch.no_grad():
            for param, (to, source) in ((q_proj.weight, q_rows), (self.kv_a_proj_with_mqa.weight, k_rows),
                                        (self.kv_a_proj_with_mqa.bias, k_rows)):
                if param is not None:
                    param[to.to(param.device)] = param[source.to(param.device)]

class DeepseekDecoderLayer(DecoderLayer):
    attention_class = LatentAttention


class DeepseekCausalLM(CausalLM):
    layer_class = DeepseekDecoderLayer
