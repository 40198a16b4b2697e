"""A sparse mixture of experts in place of a layer's MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GLM-4.5,
Granite 3 MoE, Phi-3.5-MoE, DeepSeek-V2 and V3; Llama 4's own, `InputScaledMoE`), computed as
transformers computes it, so fp32 greedy outputs match it token for token:

- the router (`gate`, a bias-free linear) scores every expert and picks each row's experts and their
  weights, each family by its own rule (`MoeConfig.routing`; one router class each, below);
- each expert is an MLP (SiLU(gate) x up, down) run on the rows routed to it, its output scaled by
  the row's weight for it and added into the result, experts in ascending order (the order of
  transformers' `index_add_`, so each row's sum is the same sum);
- Qwen2-MoE, GLM-4.5, DeepSeek and Granite's Shared variant add a shared expert every row goes through, Qwen2-MoE's
  gated by sigmoid(shared_expert_gate(x)).

Under tensor parallelism every rank routes the same rows (the router is whole on each) and holds a
slice of every expert's intermediate dimension; the experts' partial outputs are summed on each
rank and all-reduced once for the layer. The routing reads the experts' row counts on the host,
so on CUDA a mixture-of-experts model runs without CUDA graphs (model_runner.py).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.config import ModelConfig
from worker.models.linear import Linear
from worker.models.parallel import Piece, Shard

# Mixtral's (and Phi-3.5-MoE's) checkpoint names for what kvgate's module calls mlp.gate and mlp.experts.N.*_proj
_MIXTRAL = ((".mlp.", ".block_sparse_moe."), (".gate_proj.", ".w1."), (".up_proj.", ".w3."), (".down_proj.", ".w2."))


def mixtral_name(name: str) -> str:
    """A checkpoint tensor's name in a Mixtral folder (its attention's and norms' are Llama's)."""
    if ".mlp." not in name:
        return name
    for ours, theirs in _MIXTRAL:
        name = name.replace(ours, theirs)
    return name


def checkpoint_piece(piece: Piece, cfg: ModelConfig) -> Piece:
    """Where a family's checkpoint keeps a piece of kvgate's MoE layer: Mixtral's and Phi-3.5-MoE's
    block_sparse_moe names, GLM-4.5's and DeepSeek's `shared_experts`, Granite's experts stored as one tensor,
    Llama 4's `feed_forward` (its dense MLPs' too)."""
    if cfg.arch == "llama4":
        return replace(piece, name=piece.name.replace(".mlp.", ".feed_forward."))
    if cfg.arch in ("mixtral", "phimoe"):
        return replace(piece, name=mixtral_name(piece.name))
    if cfg.arch in ("glm4_moe", "deepseek_v2", "deepseek_v3"):
        return replace(piece, name=piece.name.replace(".mlp.shared_expert.", ".mlp.shared_experts."))
    if cfg.arch in ("granitemoe", "granitemoeshared"):
        return _granite_piece(piece, cfg)
    return piece


_GRANITE = re.compile(r"(.*)\.mlp\.(?:experts\.(\d+)|(shared_expert))\.(gate|up|down)_proj\.weight")


def _granite_piece(piece: Piece, cfg: ModelConfig) -> Piece:
    """Granite's router is `block_sparse_moe.router.layer`; its experts' gate and up rows one tensor,
    `block_sparse_moe.input_linear` [experts, 2 x width, hidden], gate's first, their down ones
    `output_linear` [experts, hidden, width]; the Shared variant's shared MLP `shared_mlp.input_linear`
    and `output_linear`, laid out as one expert's."""
    if piece.name.endswith(".mlp.gate.weight"):
        return replace(piece, name=piece.name.replace(".mlp.gate.", ".block_sparse_moe.router.layer."))
    found = _GRANITE.fullmatch(piece.name)
    if found is None:
        return piece
    layer, expert, shared, part = found.groups()
    module = f"{layer}.shared_mlp" if shared else f"{layer}.block_sparse_moe"
    expert = None if shared else int(expert)
    if part == "down":  # whole, or this rank's columns
        return Piece(f"{module}.output_linear.weight", piece.dim, piece.start, piece.stop, expert)
    width = cfg.moe.shared_intermediate_size if shared else cfg.moe.intermediate_size
    start, stop = (0, width) if piece.start is None else (piece.start, piece.stop)
    offset = width if part == "up" else 0
    return Piece(f"{module}.input_linear.weight", 0, offset + start, offset + stop, expert)


class Router(Linear):
    """The router's bias-free linear (`gate`: a logit an expert) and the options its rule reads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.hidden_size, cfg.moe.num_experts, bias=False)
        moe = cfg.moe
        self.top_k, self.norm_topk_prob, self.weights_fp32 = moe.top_k, moe.norm_topk_prob, moe.weights_fp32

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts) of each row, [rows, k] each."""
        raise NotImplementedError


class SoftmaxRouter(Router):
    """Mixtral's, the Qwens' and OLMoE's: softmax over every logit in fp32, the top k, renormalised
    to sum to 1 where the config says, cast to the model's dtype except in Mixtral."""

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, chosen = torch.topk(torch.softmax(self(x).float(), dim=-1), self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights if self.weights_fp32 else weights.to(x.dtype), chosen


class TopKSoftmaxRouter(Router):
    """Granite's: the top k of the logits (in fp32), their softmax, cast to the model's dtype."""

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, chosen = self(x).float().topk(self.top_k, dim=-1)
        return torch.softmax(top, dim=-1).to(x.dtype), chosen


class GroupedSigmoidRouter(Router):
    """GLM-4.5's and DeepSeek-V3's, in fp32 (its weight and bias kept in fp32 whatever the model's
    dtype, as transformers keeps them): each expert scored sigmoid(logit); the experts split into
    `groups` groups, each valued by its two best, the top k chosen from the best `chosen_groups`
    only — all by the scores plus `e_score_correction_bias`, which takes part in the choosing alone.
    Their weights are the scores without it, renormalised where the config says, x routed_scaling_factor."""

    keeps_fp32 = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.moe.num_experts))
        (self.groups, self.chosen_groups), self.scaling = cfg.moe.groups, cfg.moe.scaling

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(self(x.float()))
        for_choice = scores + self.e_score_correction_bias
        by_group = for_choice.view(-1, self.groups, scores.shape[-1] // self.groups)
        best_groups = by_group.topk(2, dim=-1)[0].sum(dim=-1).topk(self.chosen_groups, dim=-1, sorted=False)[1]
        kept = torch.zeros_like(by_group[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
        for_choice = by_group.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(1)
        chosen = torch.topk(for_choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, chosen


class GroupLimitedSoftmaxRouter(Router):
    """DeepSeek-V2's, in fp32 (its weight kept in fp32 whatever the model's dtype, as transformers keeps
    it): a softmax over every logit, the top k (topk_method "greedy": one group) or the top k of the best
    `chosen_groups` of `groups` groups, each valued by its best score ("group_limited_greedy"); their
    weights the scores as they are (not renormalised) x routed_scaling_factor."""

    keeps_fp32 = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        (self.groups, self.chosen_groups), self.scaling = cfg.moe.groups, cfg.moe.scaling

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.softmax(self(x.float()), dim=-1)
        if self.groups > 1:  # the other groups' scores zeroed, as transformers masks them
            by_group = scores.view(-1, self.groups, scores.shape[-1] // self.groups)
            best_groups = by_group.amax(dim=-1).topk(self.chosen_groups, dim=-1, sorted=False)[1]
            kept = torch.zeros_like(by_group[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
            scores = by_group.masked_fill(~kept.unsqueeze(-1), 0.0).flatten(1)
        weights, chosen = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        return weights * self.scaling, chosen


class SparseMixerRouter(Router):
    """Phi-3.5-MoE's sparsemixer as it routes in inference (transformers' eval mode), in the model's
    dtype: two picks, the best score and then the best of the rest, each weighted by its softmax
    among the scores within a relative 2 x router_jitter_noise of it (the others masked out)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.eps = cfg.moe.jitter_eps

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self(x)
        first_weight, first = self._pick(scores, scores)
        second_weight, second = self._pick(scores, scores.scatter(-1, first, float("-inf")))
        return torch.cat((first_weight, second_weight), dim=-1), torch.cat((first, second), dim=-1)

    def _pick(self, scores: torch.Tensor, left: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The best of `left` (the scores but those already picked) and its weight, [rows, 1] each."""
        best, index = left.max(dim=-1, keepdim=True)
        far = (best - scores) / scores.abs().clamp(min=best) > 2 * self.eps
        return torch.softmax(left.masked_fill(far, float("-inf")), dim=-1).gather(-1, index), index


def by_expert(chosen: torch.Tensor, weights: torch.Tensor, experts: int) -> Iterator[tuple[int, torch.Tensor,
                                                                                        torch.Tensor]]:
    """(expert, the rows routed to it, their weights for it) of each expert some row chose, experts in
    ascending order (transformers' `index_add_` order, so each row's sum is the same sum), each
    expert's rows in order (a stable sort). `chosen` and `weights`: [rows, k]."""
    order = torch.argsort(chosen.flatten(), stable=True)
    rows_of, weight_of = order // chosen.shape[-1], weights.flatten()[order]
    start = 0
    for expert, n in enumerate(torch.bincount(chosen.flatten(), minlength=experts).tolist()):
        if n:
            yield expert, rows_of[start:start + n], weight_of[start:start + n]
            start += n


ROUTERS = {"softmax": SoftmaxRouter, "top_k_softmax": TopKSoftmaxRouter, "grouped_sigmoid": GroupedSigmoidRouter,
           "sparsemixer": SparseMixerRouter, "group_limited_softmax": GroupLimitedSoftmaxRouter}


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard, mlp: type[nn.Module]):
        super().__init__()
        moe = cfg.moe
        self.shard = shard
        self.gate = ROUTERS[moe.routing](cfg)
        self.experts = nn.ModuleList(mlp(cfg, shard, moe.intermediate_size, reduce=False)
                                     for _ in range(moe.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_intermediate_size:
            self.shared_expert = mlp(cfg, shard, moe.shared_intermediate_size, reduce=False)
            if moe.shared_gate:
                self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._mix(x, lambda expert, rows: expert(rows))

    def forward_fused(self, x: torch.Tensor, ops) -> torch.Tensor:
        """forward with each expert's SiLU x up in one native pass (the CPU kernels)."""
        return self._mix(x, lambda expert, rows: expert.forward_fused(rows, ops))

    def _mix(self, x: torch.Tensor, run) -> torch.Tensor:
        weights, chosen = self.gate.route(x)  # [rows, k] each
        out = torch.zeros_like(x)
        for expert, rows, weight in by_expert(chosen, weights, len(self.experts)):
            out.index_add_(0, rows, (run(self.experts[expert], x[rows]) * weight[:, None]).to(out.dtype))
        if self.shared_expert is not None:
            shared = run(self.shared_expert, x)
            gated = self.shared_expert_gate is not None
            out = out + (torch.sigmoid(self.shared_expert_gate(x)) * shared if gated else shared)
        return self.shard.all_reduce(out) if self.shard.size > 1 else out


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class FusedExperts(nn.Module):
    """Llama 4's experts as its checkpoint stores them (this rank's slice of their width): gate_up_proj
    [experts, hidden, 2 x width], gate's columns then up's, and down_proj [experts, width, hidden],
    each applied as x @ W (not nn.Linear's x @ W^T)."""

    def __init__(self, cfg: ModelConfig, shard: Shard):
        super().__init__()
        moe = cfg.moe
        self.first, width = shard.split(moe.intermediate_size, "experts' intermediate size")
        self.full_width, self.shard = moe.intermediate_size, shard
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, cfg.hidden_size, 2 * width))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, width, cfg.hidden_size))

    def pieces(self, prefix: str, param: str) -> list[Piece]:
        """Whole, or this rank's columns of gate's and of up's, its rows of down."""
        name = f"{prefix}.{param}"
        if self.shard.size == 1:
            return [Piece(name)]
        start, stop = self.first, self.first + self.down_proj.shape[1]
        if param == "down_proj":
            return [Piece(name, 1, start, stop)]
        return [Piece(name, 2, start, stop), Piece(name, 2, self.full_width + start, self.full_width + stop)]

    def forward(self, expert: int, x: torch.Tensor, silu_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return silu_mul(x @ self.gate_up_proj[expert]) @ self.down_proj[expert]


class InputScaledMoE(nn.Module):
    """Llama 4's mixture of experts, as transformers computes it: the router (a bias-free linear) keeps
    each row's top k logits, its weights their sigmoids (in fp32, cast back), and each weight scales
    the row *before* its expert, not the expert's output. transformers runs every expert on every
    row, the unchosen on rows scaled to zero, which come out zero (no biases): only the chosen add.
    A shared expert, as wide as each expert, every row goes through, added last. Under tensor
    parallelism as SparseMoE: the router whole on each rank, a slice of every expert, one all-reduce."""

    def __init__(self, cfg: ModelConfig, shard: Shard, mlp: type[nn.Module]):
        super().__init__()
        self.top_k, self.shard = cfg.moe.top_k, shard
        self.router = Linear(cfg.hidden_size, cfg.moe.num_experts, bias=False)
        self.experts = FusedExperts(cfg, shard)
        self.shared_expert = mlp(cfg, shard, cfg.moe.shared_intermediate_size, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._mix(x, _silu_mul, self.shared_expert(x))

    def forward_fused(self, x: torch.Tensor, ops) -> torch.Tensor:
        """forward with SiLU x up in one native pass (the CPU kernels)."""
        return self._mix(x, ops.silu_mul, self.shared_expert.forward_fused(x, ops))

    def _mix(self, x: torch.Tensor, silu_mul, shared: torch.Tensor) -> torch.Tensor:
        top, chosen = torch.topk(self.router(x), self.top_k, dim=-1)
        weights = torch.sigmoid(top.float()).to(x.dtype)
        out = torch.zeros_like(x)
        for expert, rows, weight in by_expert(chosen, weights, self.experts.down_proj.shape[0]):
            out.index_add_(0, rows, self.experts(expert, x[rows] * weight[:, None], silu_mul))
        out = out + shared
        return self.shard.all_reduce(out) if self.shard.size > 1 else out


def sparse_moe(cfg: ModelConfig, shard: Shard, mlp: type[nn.Module]) -> nn.Module:
    """A sparse layer's module: Llama 4's own, else SparseMoE with the family's router."""
    return (InputScaledMoE if cfg.moe.routing == "sigmoid_inputs" else SparseMoE)(cfg, shard, mlp)
