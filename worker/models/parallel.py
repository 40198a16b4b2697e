"""Tensor-parallel layers: each of N ranks holds a slice of every weight and of the KV cache.

Megatron's split, as vLLM and nano-vllm do it: q/k/v and gate/up are column-parallel (each rank
computes its own heads and its own part of the MLP, no communication), o and down are
row-parallel (each rank's partial product, summed by one all-reduce). The embedding and the LM head
split the vocabulary (padded up to a multiple of N; the padding rows are zeros); the embedding sums
the ranks' lookups, the head gathers its logits on rank 0, the only rank that samples.
Attention heads split evenly; KV heads too, or, when there are fewer KV heads than ranks, each rank
holds a copy of the one KV head its query heads read.

Each sharded layer says which rows or columns of which checkpoint tensors it holds (`pieces`), so
the loader reads only those bytes (safetensors get_slice), never the whole tensor.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.config import ModelConfig
from worker.models.linear import Linear, linear


@dataclass(frozen=True)
class Piece:
    """Rows (dim 0) or columns (dim 1) [start, stop) of one checkpoint tensor; start None: all of it.
    `expert`: one expert's part of a tensor that stores them all, [experts, ...] (Granite's), which
    dim, start and stop then count within."""

    name: str
    dim: int = 0
    start: int | None = None
    stop: int | None = None
    expert: int | None = None


class Shard:
    """This process's place in its tensor-parallel group, and the collectives the layers call.
    The time spent in them is counted: on CPU it is the price of TP the benchmark reports."""

    def __init__(self, rank: int = 0, size: int = 1):
        self.rank, self.size = rank, size
        self.comm_seconds = 0.0

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's even share of `total`; ValueError if it does not divide."""
        if total % self.size:
            raise ValueError(f"tensor_parallel_size {self.size} does not divide the model's {what} "
                             f"({total})")
        n = total // self.size
        return self.rank * n, n

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank holds: its share, or the one its query heads
        read when there are fewer KV heads than ranks (then N must be a multiple of them)."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "KV heads")
        if self.size % num_kv_heads:
            raise ValueError(f"tensor_parallel_size {self.size} is neither a divisor nor a multiple "
                             f"of the model's KV heads ({num_kv_heads})")
        return self.rank * num_kv_heads // self.size, 1

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """(start, rows) of this rank's slice of the vocabulary, padded up to a multiple of N."""
        rows = -(-vocab_size // self.size)
        return self.rank * rows, rows

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        start = time.perf_counter()
        dist.all_reduce(x)
        self.comm_seconds += time.perf_counter() - start
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's columns side by side; the others get their own back (a CUDA graph
        needs a tensor out of every rank's step)."""
        import torch.distributed as dist

        start = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        self.comm_seconds += time.perf_counter() - start
        return torch.cat(parts, dim=-1) if parts is not None else x


SINGLE = Shard()


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Every split the layers make, tried before any rank starts: a clear error, not a stuck group."""
    for rank in range(size):
        shard = Shard(rank, size)
        shard.split(cfg.num_heads, "attention heads")
        shard.kv_heads(cfg.num_heads, cfg.num_kv_heads)
        shard.split(cfg.intermediate_size, "intermediate size")
        if cfg.moe is not None:
            shard.split(cfg.moe.intermediate_size, "experts' intermediate size")
            if cfg.moe.shared_intermediate_size:
                shard.split(cfg.moe.shared_intermediate_size, "shared expert's intermediate size")


class ParallelRMSNorm(nn.Module):
    """An RMSNorm over a width split across the ranks (OLMo's q and k norms, across all heads):
    each rank's sum of squares all-reduced, its slice of the weight. A rank holding a copy of a
    KV head another rank also holds (`copies` > 1: fewer KV heads than ranks) counts it once.
    `cast_last`: OLMo 2's order (weight x the fp32 value, then cast)."""

    def __init__(self, start: int, width: int, full_width: int, eps: float, shard: Shard, copies: int = 1,
                 cast_last: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.start, self.full_width, self.eps, self.shard = start, full_width, eps, shard
        self.copies, self.cast_last = copies, cast_last

    def pieces(self, prefix: str, param: str) -> list[Piece]:
        return [Piece(f"{prefix}.{param}", 0, self.start, self.start + self.weight.shape[0])]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        squares = self.shard.all_reduce(x.pow(2).sum(-1, keepdim=True))
        if self.copies > 1:
            squares = squares / self.copies
        x = x * torch.rsqrt(squares / self.full_width + self.eps)
        return (self.weight * x).to(dtype) if self.cast_last else self.weight * x.to(dtype)


class ColumnParallelLinear(Linear):
    """Output features split: this rank's rows of each checkpoint part, fused side by side.
    `parts`: (checkpoint module name, first row, rows) per fused part, e.g. q_proj, k_proj, v_proj."""

    def __init__(self, in_features: int, parts: list[tuple[str, int, int]], bias: bool):
        super().__init__(in_features, sum(n for _, _, n in parts), bias=bias)
        self.parts = parts

    def pieces(self, prefix: str, param: str) -> list[Piece]:
        base = prefix.rpartition(".")[0]
        return [Piece(f"{base}.{part}.{param}", 0, start, start + n) for part, start, n in self.parts]


class RowParallelLinear(Linear):
    """Input features split: partial products summed across ranks; the bias added once, after.
    With `reduce` False the partial product is returned for the caller to sum (a mixture of
    experts adds its experts' partials first and all-reduces once); rank 0's carries the bias."""

    def __init__(self, in_start: int, in_features: int, out_features: int, bias: bool, shard: Shard,
                 reduce: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self.in_start, self.shard, self.reduce = in_start, shard, reduce

    def pieces(self, prefix: str, param: str) -> list[Piece]:
        if param == "bias":
            return [Piece(f"{prefix}.bias")]
        return [Piece(f"{prefix}.weight", 1, self.in_start, self.in_start + self.in_features)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, None)
        if self.reduce:
            y = self.shard.all_reduce(y)
        return y if self.bias is None or not (self.reduce or self.shard.rank == 0) else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the vocabulary; a token outside them looks up zeros, and the all-reduce
    of the ranks' lookups is the embedding (adding exact zeros: identical to one lookup)."""

    def __init__(self, vocab_size: int, dim: int, shard: Shard):
        super().__init__()
        self.vocab_size, self.shard = vocab_size, shard
        self.start, self.rows = shard.vocab_rows(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.rows, dim))

    def pieces(self, prefix: str, param: str) -> list[Piece]:
        """Rows past the vocabulary (the padding) are in no piece: the loader leaves them zero."""
        stop = min(self.start + self.rows, self.vocab_size)
        return [Piece(f"{prefix}.{param}", 0, self.start, stop)] if stop > self.start else []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        y = F.embedding(local.masked_fill(~mine, 0), self.weight)
        return self.shard.all_reduce(y.masked_fill_(~mine.unsqueeze(-1), 0.0))


class ParallelLMHead(VocabParallelEmbedding):
    """Logits of this rank's vocabulary rows (and their bias, where the head has one: Phi-3.5-MoE's),
    gathered on rank 0 and cut back to the vocabulary."""

    def __init__(self, vocab_size: int, dim: int, shard: Shard, bias: bool = False):
        super().__init__(vocab_size, dim, shard)
        self.bias = nn.Parameter(torch.empty(self.rows)) if bias else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.shard.gather_columns(linear(hidden, self.weight, self.bias))
        return logits[:, :self.vocab_size] if self.shard.rank == 0 else logits
