"""gpt-oss (GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b) on the Llama family's attention, linears and
paged cache, with what gpt-oss does differently, each as transformers computes it:

- a learned sink logit per attention head, one more term in each softmax's denominator with no
  value (`Attention.sinks`; every attention backend takes it);
- sliding (128-token) and full layers in turn; q/k/v and o with biases; YaRN;
- norms that multiply by their weight in fp32 and cast the product (OLMo's order);
- a mixture of experts in every layer: the router a linear with a bias, a softmax over the top k
  of its logits; each expert's gate and up interleaved in one weight stored [in, out] (column 2j
  gate j, 2j + 1 up j), both with biases, and a clamped SwiGLU: gate clamped above at `limit`,
  up to [-limit, limit], (up + 1) x gate x sigmoid(alpha x gate); then down, with its bias.

The released folders store the experts in MXFP4 (`*_blocks`, `*_scales`: two 4-bit values a byte,
one power-of-two scale per 32); the loader dequantizes them to the serving dtype as they load
(loader.py), so the served model is the bf16 one transformers dequantizes to.

Under tensor parallelism each rank holds its heads' sinks and a slice of every expert's
intermediate dimension (a run of gate/up pairs, contiguous in the interleaved layout), the down
bias on rank 0 only; the experts' partial outputs are all-reduced once for the layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.config import ModelConfig
from worker.models.llama import Attention, CausalLM
from worker.models.moe import by_expert
from worker.models.olmo import OlmoRMSNorm
from worker.models.parallel import SINGLE, Piece, Shard


class Router(nn.Module):
    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.bias = nn.Parameter(torch.empty(experts))


class Experts(nn.Module):
    """Every expert's weights in the checkpoint's layout (this rank's slice of their width)."""

    def __init__(self, cfg: ModelConfig, shard: Shard):
        super().__init__()
        experts, hidden = cfg.moe.num_experts, cfg.hidden_size
        self.first, width = shard.split(cfg.moe.intermediate_size, "experts' intermediate size")
        self.shard = shard
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * width))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * width))
        self.down_proj = nn.Parameter(torch.empty(experts, width, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))

    def pieces(self, prefix: str, param: str) -> list[Piece]:
        name = f"{prefix}.{param}"
        if self.shard.size == 1:
            return [Piece(name)]
        start, stop = self.first, self.first + self.down_proj.shape[1]
        return {"gate_up_proj": [Piece(name, 2, 2 * start, 2 * stop)],
                "gate_up_proj_bias": [Piece(name, 1, 2 * start, 2 * stop)],
                "down_proj": [Piece(name, 1, start, stop)],
                "down_proj_bias": [Piece(name)] if self.shard.rank == 0 else []}[param]  # []: zeros


class GptOssMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard = SINGLE):
        super().__init__()
        self.top_k, (self.alpha, self.limit), self.shard = cfg.moe.top_k, cfg.swiglu, shard
        self.router = Router(cfg.hidden_size, cfg.moe.num_experts)
        self.experts = Experts(cfg, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, chosen = torch.topk(F.linear(x, self.router.weight, self.router.bias), self.top_k, dim=-1)
        weights = torch.softmax(top, dim=1, dtype=top.dtype)  # [rows, k]
        experts, out = self.experts, torch.zeros_like(x)
        for e, rows, weight in by_expert(chosen, weights, experts.gate_up_proj.shape[0]):
            gate_up = x[rows] @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
            y = self._swiglu(gate_up) @ experts.down_proj[e] + experts.down_proj_bias[e]  # zeros but on rank 0
            out.index_add_(0, rows, (y * weight[:, None]).to(out.dtype))
        return self.shard.all_reduce(out) if self.shard.size > 1 else out

    def forward_fused(self, x: torch.Tensor, ops) -> torch.Tensor:
        return self.forward(x)

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, shard: Shard, index: int):
        super().__init__()
        self.local_rope = False
        self.input_layernorm = OlmoRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend, shard, cfg.layer_windows[index])
        self.post_attention_layernorm = OlmoRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GptOssMoE(cfg, shard)

    def forward(self, h, rope, kv_cache, meta):
        h = h + self.self_attn(self.input_layernorm(h), rope, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))

    post_self_attn_layernorm = post_mlp_layernorm = None  # as Llama's layer, for the fused path: no branch norms

    @staticmethod
    def branch(out: torch.Tensor, norm: None) -> torch.Tensor:
        return out


class GptOssCausalLM(CausalLM):
    """Llama's layer order, so on CPU in fp32 the base model's fused path runs it (the fused norm's
    weight x value is the same product in fp32)."""

    layer_class, norm_class = GptOssDecoderLayer, OlmoRMSNorm
