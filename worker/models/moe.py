"""A sparse mixture of experts in place of a layer's MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), computed
as transformers computes it, so fp32 greedy outputs match it token for token:

- the router (`gate`, a bias-free linear) scores every expert; softmax in fp32; the top k kept,
  renormalised to sum to 1 where the config says (`MoeConfig`);
- each expert is an MLP (SiLU(gate) x up, down) run on the rows routed to it, its output scaled by
  the row's weight for it and added into the result, experts in ascending order (the order of
  transformers' `index_add_`, so each row's sum is the same sum);
- Qwen2-MoE adds a shared expert every row goes through, gated by sigmoid(shared_expert_gate(x)).

Under tensor parallelism every rank routes the same rows (the router is whole on each) and holds a
slice of every expert's intermediate dimension; the experts' partial outputs are summed on each
rank and all-reduced once for the layer. The routing reads the experts' row counts on the host,
so on CUDA a mixture-of-experts model runs without CUDA graphs (model_runner.py).
"""
from __future__ import annotations

import torch
from torch import nn

from worker.models.config import ModelConfig
from worker.models.linear import Linear
from worker.models.parallel import Shard

# Mixtral's checkpoint names for what kvgate's module calls mlp.gate and mlp.experts.N.*_proj
_MIXTRAL = ((".mlp.", ".block_sparse_moe."), (".gate_proj.", ".w1."), (".up_proj.", ".w3."), (".down_proj.", ".w2."))


def mixtral_name(name: str) -> str:
    """A checkpoint tensor's name in a Mixtral folder (its attention's and norms' are Llama's)."""
    if ".mlp." not in name:
        return name
    for ours, theirs in _MIXTRAL:
        name = name.replace(ours, theirs)
    return name


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard, mlp: type[nn.Module]):
        super().__init__()
        moe = cfg.moe
        self.top_k, self.norm_topk_prob, self.weights_fp32 = moe.top_k, moe.norm_topk_prob, moe.weights_fp32
        self.shard = shard
        self.gate = Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(mlp(cfg, shard, moe.intermediate_size, reduce=False)
                                     for _ in range(moe.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_intermediate_size:
            self.shared_expert = mlp(cfg, shard, moe.shared_intermediate_size, reduce=False)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._mix(x, lambda expert, rows: expert(rows))

    def forward_fused(self, x: torch.Tensor, ops) -> torch.Tensor:
        """forward with each expert's SiLU x up in one native pass (the CPU kernels)."""
        return self._mix(x, lambda expert, rows: expert.forward_fused(rows, ops))

    def _mix(self, x: torch.Tensor, run) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [rows, k] each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_fp32:
            weights = weights.to(x.dtype)
        # the (row, slot) pairs grouped by expert, ascending; a stable sort keeps rows in order
        order = torch.argsort(chosen.flatten(), stable=True)
        rows_of, weight_of = order // self.top_k, weights.flatten()[order]
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, n in zip(self.experts, counts):
            if n:
                rows = rows_of[start:start + n]
                y = run(expert, x[rows]) * weight_of[start:start + n, None]
                out.index_add_(0, rows, y.to(out.dtype))
                start += n
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * run(self.shared_expert, x)
        return self.shard.all_reduce(out) if self.shard.size > 1 else out
