"""Llama (and Mistral, Phi-3), Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm) as one module family,
and their mixture-of-experts kin (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5, Granite 3 MoE: moe.py's layer
in place of the MLP); Granite is Llama's with four scalars (embeddings, residual branches, scores and
logits scaled); SmolLM3 Llama's with some layers unrotated (NoPE); Ministral 3 Mistral's with its
queries scaled up past the original context (Llama 4's scaling); OLMoE Llama's with q and k each
RMS-normed across all their heads, q/k/v clipped, and experts; GLM Llama's with half of each head
rotated, by adjacent pairs (`rotate_pairs_as_halves`), GLM-4-0414 with each branch's output normed
too (`branch`); Hunyuan Llama's with q and k normed once rotated (`norm_after_rope`); Llama 4 Llama's
with RoPE by adjacent pairs, q and k normed without weights once rotated in its rotated layers, its
NoPE layers' queries scaled by position (temperature tuning), and moe.py's InputScaledMoE in its
sparse layers.

Parameter names follow the Hugging Face checkpoints, except q/k/v and gate/up, which are fused into
one matmul each (fewer, larger GEMMs); `checkpoint_pieces` says where each fused part comes from.
Every op mirrors transformers' order of operations so fp32 greedy outputs match it token for token.
With a Shard of size N > 1 the layers are parallel.py's sharded ones; at N = 1 they are the plain
ones, the single-device code path unchanged.

On CPU in fp32 the runner hands the model native kernels (`cpu_kernels`, engine/cpu_native.py):
the same layers then run their element-wise work fused (`_forward_fused`): the residual add folded
into the next RMSNorm, q/k norm and rope in place in the qkv rows, SiLU x up in one pass.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from worker.engine.attention import AttentionMetadata
from worker.engine.cpu_native import CpuKernels
from worker.models.config import ModelConfig
from worker.models.linear import Linear
from worker.models.moe import checkpoint_piece, sparse_moe
from worker.models.parallel import (SINGLE, ColumnParallelLinear, ParallelLMHead, ParallelRMSNorm, Piece,
                                    RowParallelLinear, Shard, VocabParallelEmbedding)

_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class RMSNorm(nn.Module):
    cast_last = False  # OLMo 2's: the weight multiplies in fp32 and the product is cast (Llama's: cast, then multiply)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(dtype) if self.cast_last else self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, the factor cos and sin are scaled by): plain RoPE, or linear, llama3
    (band-wise smoothed), YaRN or LongRoPE context extension, each computed as transformers does."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling["rope_type"] if scaling else "default"
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / scaling["factor"], 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    if kind == "longrope":
        return _long_rope(head_dim, theta, scaling)
    if kind != "llama3":
        raise ValueError(f"unsupported rope_type {kind!r}: default, linear, llama3, yarn or longrope")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled), 1.0


def _yarn(dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): frequencies interpolated by `factor` below a band of dimensions,
    kept above it, ramped linearly between; cos and sin scaled by 0.1 ln(factor) + 1 (or by the
    config's attention_factor, or DeepSeek's mscale ratio)."""
    old_len, factor = scaling["original_max_position_embeddings"], scaling["factor"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)

    def band_edge(rotations: float) -> float:  # the dimension that turns `rotations` times in old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = band_edge(scaling.get("beta_fast") or 32), band_edge(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    kept = 1 - ramp  # the share of each frequency extrapolated (kept as it was trained)
    inv = (1.0 / (factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept
    return inv, attention


def _long_rope(dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3's long-context variants) within its original context, where transformers uses
    the short factors (config.py caps the context there): each frequency divided by its factor, cos
    and sin scaled by sqrt(1 + ln(factor) / ln(original context))."""
    old, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
    short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
    return 1.0 / (short * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), attention


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin over each head's first cos.shape[-1] values; the rest pass
    (partial rotary embeddings: Phi-4-mini rotates 3/4 of each head)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


def _rope(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
          scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's angles (the float32 product, as transformers forms it). On
    the CPU they are taken in float64: on the Intel Xeon of 2026-12-08 about one process in six had
    one OpenMP thread whose float32 cos was off by up to 1.5e-4 for angles of ~1,000 (the rows that
    thread computed; the same process computed them right again) — float64's answer rounds to the
    right float32 whatever that thread's state was."""
    freqs = positions.to(torch.float32).unsqueeze(1) * inv_freq.unsqueeze(0)
    emb = torch.cat((freqs, freqs), dim=-1)
    if emb.device.type == "cpu":
        emb = emb.double()
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama 4's q/k norm: each head RMS-normed in fp32, with no weight, cast back."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class Rope(NamedTuple):
    """The position encoding of a step's rows: cos and sin [T, 1, rotary dim], and Ministral 3's or
    Llama 4's query scale [T, 1, 1] (None in every other model)."""

    cos: torch.Tensor
    sin: torch.Tensor
    q_scale: torch.Tensor | None = None


class Attention(nn.Module):
    """This rank's query heads and the KV heads they read (all of them at N = 1)."""

    def __init__(self, cfg: ModelConfig, backend, shard: Shard = SINGLE, window: int | None = None,
                 rope: bool = True, norm: type[nn.Module] = RMSNorm):
        super().__init__()
        self.window = window  # a sliding window's width (the backend masks keys before it), else None
        self.rope = rope  # SmolLM3's NoPE layers: False
        d = self.head_dim = cfg.head_dim
        q_first, self.num_heads = shard.split(cfg.num_heads, "attention heads")
        kv_first, self.num_kv_heads = shard.kv_heads(cfg.num_heads, cfg.num_kv_heads)
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard.size == 1:
            self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
            self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        else:
            parts = [("q_proj", q_first * d, self.q_size), ("k_proj", kv_first * d, self.kv_size),
                     ("v_proj", kv_first * d, self.kv_size)]
            self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, parts, cfg.qkv_bias)
            self.o_proj = RowParallelLinear(q_first * d, self.q_size, cfg.hidden_size, cfg.o_bias, shard)
        if cfg.qk_norm == "head":  # `norm`: the family's RMSNorm (Gemma's, OLMo's)
            self.q_norm, self.k_norm = norm(d, cfg.rms_norm_eps), norm(d, cfg.rms_norm_eps)
        elif cfg.qk_norm == "whole":
            self.q_norm, self.k_norm = _whole_width_norms(cfg, shard, q_first * d, kv_first * d, self.q_size,
                                                         self.kv_size, norm)
        # Llama 4's weightless q/k norms: in its rotated layers only
        self.qk_norm = None if cfg.qk_norm == "weightless" and not rope else cfg.qk_norm
        self.clip, self.shard, self.eps = cfg.clip_qkv, shard, cfg.rms_norm_eps
        self.norm_after_rope = cfg.qk_norm_after_rope  # Hunyuan's and Llama 4's q/k norms: on the rotated heads
        self.q_scaled = cfg.attn_temperature is None or not rope  # Llama 4's temperature: its NoPE layers only
        self.scale = cfg.multipliers["attention_multiplier"] if cfg.multipliers else cfg.head_dim ** -0.5
        self.softcap: float | None = None  # Gemma 2's attention soft-cap (gemma.py sets it)
        self.chunk: int | None = None  # Llama 4's chunked layers' attention chunk (DecoderLayer sets it)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if cfg.attn_sinks else None  # gpt-oss's, per head
        self.q_first, self.backend = q_first, backend

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self._heads(self.qkv_proj(x))
        if not self.norm_after_rope:
            q, k = self._norm_qk(q, k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        if self.rope:
            q, k = _rotary(q, rope.cos, rope.sin), _rotary(k, rope.cos, rope.sin)
        if self.norm_after_rope:
            q, k = self._norm_qk(q, k)
        if rope.q_scale is not None and self.q_scaled:
            q = (q * rope.q_scale).to(q.dtype)
        return self._attend(q, k, v, kv_cache, meta)

    def forward_fused(self, x: torch.Tensor, positions: torch.Tensor, rope_table: torch.Tensor,
                      kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                      ops: CpuKernels, q_scale: torch.Tensor | None = None) -> torch.Tensor:
        """forward's steps, with q/k norm and rope applied in place to the qkv rows."""
        qkv = self.qkv_proj(x).contiguous()
        if not self.norm_after_rope:
            self._norm_qk_fused(qkv, ops)
        if self.clip is not None:
            qkv.clamp_(-self.clip, self.clip)
        if self.rope:
            ops.rope_(qkv, positions, rope_table, self.num_heads + self.num_kv_heads)  # q's heads, then k's
        if self.norm_after_rope:
            self._norm_qk_fused(qkv, ops)
        if q_scale is not None and self.q_scaled:
            qkv[:, :self.q_size].view(-1, self.num_heads, self.head_dim).mul_(q_scale)
        return self._attend(*self._heads(qkv), kv_cache, meta)

    def _norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.qk_norm == "head":
            return self.q_norm(q), self.k_norm(k)
        if self.qk_norm == "whole":
            return self.q_norm(q.flatten(1)).view_as(q), self.k_norm(k.flatten(1)).view_as(k)
        if self.qk_norm == "weightless":
            return weightless_rms_norm(q, self.eps), weightless_rms_norm(k, self.eps)
        return q, k

    def _norm_qk_fused(self, qkv: torch.Tensor, ops: CpuKernels) -> None:
        """_norm_qk's, in place on the qkv rows."""
        if self.qk_norm == "head":
            ops.head_rmsnorm_(qkv, 0, self.num_heads, self.q_norm.weight, self.q_norm.eps)
            ops.head_rmsnorm_(qkv, self.q_size, self.num_kv_heads, self.k_norm.weight, self.k_norm.eps)
        elif self.qk_norm == "whole" and self.shard.size > 1:  # their sums of squares all-reduced
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        elif self.qk_norm == "whole":  # q as one head of q_size values, k as one of kv_size
            ops.head_rmsnorm_(qkv, 0, 1, self.q_norm.weight, self.q_norm.eps, self.q_size)
            ops.head_rmsnorm_(qkv, self.q_size, 1, self.k_norm.weight, self.k_norm.eps, self.kv_size)
        elif self.qk_norm == "weightless":  # torch's, written back into q's and k's heads in the rows
            for heads in self._heads(qkv)[:2]:
                heads.copy_(weightless_rms_norm(heads, self.eps))

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))

    def _attend(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        self.backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = self.backend.attend(q, k_cache, v_cache, meta, self.scale, self.window, self.softcap, self.sinks,
                                  self.chunk)
        return self.o_proj(out.reshape(-1, self.q_size))

    def pieces(self, prefix: str, param: str) -> list[Piece]:
        """The one parameter of its own, gpt-oss's sinks: this rank's heads'."""
        return [Piece(f"{prefix}.{param}", 0, self.q_first, self.q_first + self.num_heads)]

    def rotate_pairs_as_halves(self, rotary_dim: int) -> None:
        """Once loaded, for GLM and Cohere: their RoPE turns each head's values 2i and 2i + 1 together,
        ours i and i + rotary_dim / 2. With q's and k's rows reordered within each head (the even ones,
        then the odd ones, then those not rotated) ours turns the same pairs by the same angles; a
        score, the dot product of a query and a key head, is the same sum under one reordering of
        both, and v keeps its order. So every path (native, torch, Triton; sharded or not) computes
        theirs. A per-head q/k norm (Cohere's) is reordered with its heads."""
        d, rows = self.head_dim, self.q_size + self.kv_size  # this rank's q heads, then its k heads
        order = torch.cat((torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2), torch.arange(rotary_dim, d)))
        index = (torch.arange(0, rows, d).unsqueeze(1) + order).flatten()
        norms = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm == "head" else ()
        with torch.no_grad():
            for param in (self.qkv_proj.weight, self.qkv_proj.bias):
                if param is not None:
                    param[:rows] = param[:rows][index.to(param.device)]
            for weight in norms:
                weight.copy_(weight[..., order.to(weight.device)])


def _whole_width_norms(cfg: ModelConfig, shard: Shard, q_start: int, k_start: int, q_size: int, kv_size: int,
                      norm: type[nn.Module]) -> tuple[nn.Module, nn.Module]:
    """OLMo's q and k norms, each across all of q's or k's heads: plain `norm`s on one device, under
    tensor parallelism over each rank's slice with the sums of squares all-reduced."""
    if shard.size == 1:
        return norm(q_size, cfg.rms_norm_eps), norm(kv_size, cfg.rms_norm_eps)
    d, cast_last = cfg.head_dim, getattr(norm, "cast_last", False)
    copies = max(1, shard.size // cfg.num_kv_heads)  # ranks holding each KV head
    return (ParallelRMSNorm(q_start, q_size, cfg.num_heads * d, cfg.rms_norm_eps, shard, cast_last=cast_last),
            ParallelRMSNorm(k_start, kv_size, cfg.num_kv_heads * d, cfg.rms_norm_eps, shard, copies, cast_last))


class MLP(nn.Module):
    """SiLU(gate) x up, then down: `intermediate` wide (the config's unless said: an expert's);
    under tensor parallelism `reduce` False leaves the ranks' partial outputs for the caller to sum."""

    def __init__(self, cfg: ModelConfig, shard: Shard = SINGLE, intermediate: int | None = None,
                 reduce: bool = True):
        super().__init__()
        inter = intermediate or cfg.intermediate_size
        if shard.size == 1:
            self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=cfg.mlp_bias)
            self.down_proj = Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)
            return
        first, n = shard.split(inter, "intermediate size")
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [("gate_proj", first, n), ("up_proj", first, n)],
                                                 cfg.mlp_bias)
        self.down_proj = RowParallelLinear(first, n, cfg.hidden_size, cfg.mlp_bias, shard, reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def forward_fused(self, x: torch.Tensor, ops: CpuKernels) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    norm_class: type[nn.Module] = RMSNorm  # the norms before the branches (OLMo 1's: a LayerNorm)
    attention_class: type[nn.Module] = Attention  # DeepSeek's: multi-head latent attention (deepseek.py)

    def __init__(self, cfg: ModelConfig, backend, shard: Shard, index: int):
        super().__init__()
        self.local_rope = cfg.local_rope(index)
        self.input_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_class(cfg, backend, shard, cfg.layer_windows[index],
                                              cfg.rope_layers is None or cfg.rope_layers[index])
        if cfg.layer_chunks is not None:
            self.self_attn.chunk = cfg.layer_chunks[index]
        self.post_attention_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        sparse = cfg.moe is not None and cfg.moe.sparse_layers[index]
        self.mlp = sparse_moe(cfg, shard, MLP) if sparse else MLP(cfg, shard)
        self.residual_multiplier = cfg.multipliers["residual_multiplier"] if cfg.multipliers else None
        self.post_self_attn_layernorm = self.post_mlp_layernorm = None
        if cfg.branch_norms:  # GLM-4-0414's
            self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, rope, kv_cache, meta):
        attn = self.self_attn(self.input_layernorm(h), rope, kv_cache, meta)
        h = h + self.branch(attn, self.post_self_attn_layernorm)
        return h + self.branch(self.mlp(self.post_attention_layernorm(h)), self.post_mlp_layernorm)

    def branch(self, out: torch.Tensor, norm: nn.Module | None) -> torch.Tensor:
        """A residual branch's output as it is added: GLM-4-0414's normed (`norm`, the branch's own),
        Granite's scaled by its residual multiplier."""
        out = out if norm is None else norm(out)
        return out if self.residual_multiplier is None else out * self.residual_multiplier


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, shard: Shard, layer: type[nn.Module], norm: type[nn.Module]):
        super().__init__()
        # the weight given (empty: the checkpoint fills it) skips nn.Embedding's random init, whose
        # path on the meta device imports torch._dynamo: ~0.5 s of every worker's start
        self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                          _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
                             if shard.size == 1 else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, shard))
        self.layers = nn.ModuleList(layer(cfg, backend, shard, i) for i in range(cfg.num_layers))
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    cpu_kernels: CpuKernels | None = None  # set by the runner where they apply (fp32 on CPU)
    fuses_on_cpu = True  # whether those kernels run the layers (`_forward_fused`), or only attention (Cohere's)
    layer_class: type[nn.Module] = DecoderLayer
    norm_class: type[nn.Module] = RMSNorm  # the final norm's

    def __init__(self, cfg: ModelConfig, backend, shard: Shard = SINGLE):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg, backend, shard, self.layer_class, self.norm_class)
        self.lm_head = (Linear(cfg.hidden_size, cfg.vocab_size, bias=cfg.lm_head_bias) if shard.size == 1
                        else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, shard, cfg.lm_head_bias))
        self.inv_freq: torch.Tensor | None = None
        self.local_inv_freq: torch.Tensor | None = None  # the sliding layers' own RoPE (Gemma 3, OLMo 3)
        self.rope_scale = 1.0  # YaRN's attention factor on cos and sin (the full layers')
        self._rope_tables: dict[bool, torch.Tensor] = {}  # CPU, by local: [positions, 2, head_dim] cos and sin

    def init_rope(self, device: torch.device) -> None:
        """Kept out of the state dict: it is derived from the config, not loaded."""
        cfg = self.cfg
        inv_freq, self.rope_scale = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        self.inv_freq = inv_freq.to(device)
        if cfg.local_rope_theta is not None:
            self.local_inv_freq = rope_inv_freq(cfg.rotary_dim, cfg.local_rope_theta, None)[0].to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [T, hidden] of the flattened batch."""
        if self.cpu_kernels is not None and self.fuses_on_cpu:
            return self._forward_fused(input_ids, positions, kv_caches, meta)
        h = self._embed(input_ids)
        ropes = self._ropes(positions, h.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h = layer(h, ropes[layer.local_rope], kv_cache, meta)
        return self.model.norm(h)

    def _forward_fused(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """forward with native element-wise kernels: each residual add is fused into the RMSNorm
        after it (the input norm of the next layer, the final norm after the last), in place on
        the residual stream h."""
        ops, layers = self.cpu_kernels, self.model.layers
        h = self._embed(input_ids)  # a fresh tensor: the residual stream, updated in place
        tables, q_scale = self._rope_tables_for(positions, h.dtype), self._query_scale(positions, h.dtype)
        after_mlp = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        x = ops.add_rmsnorm(h, None, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps)
        for layer, kv_cache, norm in zip(layers, kv_caches, after_mlp):
            table = tables[layer.local_rope]
            attn = layer.self_attn.forward_fused(x, positions, table, kv_cache, meta, ops, q_scale)
            attn = layer.branch(attn, layer.post_self_attn_layernorm)
            x = ops.add_rmsnorm(h, attn, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
            mlp = layer.branch(layer.mlp.forward_fused(x, ops), layer.post_mlp_layernorm)
            x = ops.add_rmsnorm(h, mlp, norm.weight, norm.eps)
        return x

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        return h * self.cfg.multipliers["embedding_multiplier"] if self.cfg.multipliers else h

    def _ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[bool, Rope]:
        """The rows' Rope by whether a layer is rotated by the sliding layers' RoPE. On CPU cos and
        sin are looked up in a table grown as positions grow (the same products, computed once, not
        every step); elsewhere computed in place (no host sync, so CUDA graphs can capture it)."""
        q_scale = self._query_scale(positions, dtype)
        if positions.device.type != "cpu":
            ropes = {False: Rope(*_rope(positions, self.inv_freq, dtype, self.rope_scale), q_scale)}
            if self.local_inv_freq is not None:
                ropes[True] = Rope(*_rope(positions, self.local_inv_freq, dtype), q_scale)
            return ropes
        tables = self._rope_tables_for(positions, dtype)
        both = {local: table.index_select(0, positions) for local, table in tables.items()}
        return {local: Rope(rows[:, :1], rows[:, 1:], q_scale) for local, rows in both.items()}

    def _query_scale(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """[T, 1, 1], as transformers computes each: Ministral 3's (Llama 4's scaling), in the model's
        dtype, queries x 1 + beta ln(1 + floor(position / original context)) — 1 within the original
        context, growing by steps past it; Llama 4's temperature tuning, in fp32 (the product cast),
        x 1 + attn_scale ln(1 + floor((position + 1) / floor_scale)); None elsewhere."""
        if self.cfg.attn_temperature is not None:
            scale, floor = self.cfg.attn_temperature
            return (torch.log1p(torch.floor((positions.float() + 1.0) / floor)) * scale + 1.0)[:, None, None]
        if self.cfg.query_scaling is None:
            return None
        beta, context = self.cfg.query_scaling
        return (1 + beta * torch.log(1 + torch.floor(positions / context))).to(dtype)[:, None, None]

    def _rope_tables_for(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[bool, torch.Tensor]:
        """By local, [>= max position + 1, 2, head_dim]: cos and sin per position, grown by doubling."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        kinds = {False: (self.inv_freq, self.rope_scale)}
        if self.local_inv_freq is not None:
            kinds[True] = (self.local_inv_freq, 1.0)
        for local, (inv_freq, scale) in kinds.items():
            table = self._rope_tables.get(local)
            if table is None or table.shape[0] < need or table.dtype != dtype:
                size = max(need, 2 * (table.shape[0] if table is not None else 512))
                cos, sin = _rope(torch.arange(size, device=positions.device), inv_freq, dtype, scale)
                self._rope_tables[local] = torch.cat((cos, sin), dim=1)
        return self._rope_tables

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab]; under tensor parallelism only rank 0's are the whole rows."""
        logits = self.lm_head(hidden)
        return logits / self.cfg.multipliers["logits_scaling"] if self.cfg.multipliers else logits

    def checkpoint_pieces(self, name: str) -> list[Piece]:
        """The checkpoint tensors (or this rank's slices of them) a parameter is the
        concatenation of: a sharded layer says which; a plain fused one takes its parts whole."""
        module_name, _, param = name.rpartition(".")
        module = self.get_submodule(module_name)
        if hasattr(module, "pieces"):
            pieces = module.pieces(module_name, param)
        else:
            pieces = next(([Piece(name.replace(fused, part)) for part in parts]
                           for fused, parts in _FUSED.items() if f".{fused}." in name), [Piece(name)])
        return [checkpoint_piece(p, self.cfg) for p in pieces] if self.cfg.moe is not None else pieces
