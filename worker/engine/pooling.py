"""Embeddings (OpenAI's /v1/embeddings): a sequence that pools its input's final hidden states instead
of sampling a token. Each input is a prefill-only sequence in the paged engine, batched and chunked
with everything else; it ends when its prefill does, its vector the last token's state ("last") or
the mean of every token's ("mean", summed chunk by chunk), cut to the request's dimensions and
L2-normalized where the model folder says (worker/models/pooling.py). A reranker's input (a rendered
(query, document) pair) pools its last token the same way and ends as one number: sigmoid(w · state + b),
its folder's score head.

How the prefix cache meets it: "last" needs only the last position computed, which the engine always
computes, so its inputs take cache hits as prompts do; "mean" needs every position's state, so its
inputs compute all of theirs (Sequence.cacheable_tokens). A preempted "mean" input starts its sum
again with its recompute.

Bounded work: an input is at most a context's worth of tokens, a request at most MAX_INPUTS inputs
and MAX_BYTES of vectors (they travel in the worker's reply messages, as prompt scores do), and a
request holds at most AT_ONCE inputs in the scheduler at a time (the rest queue in the engine), so
one large batch of inputs takes the places an n = 16 request would, not all of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.engine.types import EngineRejected

MAX_INPUTS = 2048  # OpenAI's bound on one request's inputs
MAX_BYTES = 8 << 20  # a request's vectors as float32: the bound one reply's prompt scores have (base.py)
AT_ONCE = 16  # a request's inputs in the scheduler at once (base.MAX_N: what a request's n may take)


@dataclass(frozen=True, eq=False)
class Embed:
    """How one input becomes its vector."""

    mode: str  # "last" or "mean"
    length: int  # the vector's dimensions: the hidden size, or a Matryoshka model's requested cut
    normalize: bool
    head: tuple[torch.Tensor, float] | None = None  # a reranker's (w, b): the vector is its one score


def check(pooling, hidden_size: int, num_inputs: int, dimensions: int | None) -> int:
    """The vectors' length for a request of `num_inputs` inputs asking for `dimensions` (None: all),
    or EngineRejected naming the bound (`pooling`: the folder's worker/models/pooling.Pooling)."""
    if not 1 <= num_inputs <= MAX_INPUTS:
        raise EngineRejected(f"{num_inputs} inputs; a request embeds 1 to {MAX_INPUTS}", "invalid_request", "input")
    length = hidden_size if dimensions is None else dimensions
    if dimensions is not None and dimensions != hidden_size:
        if pooling.dimensions is None:
            raise EngineRejected(f"dimensions {dimensions}: this model is not a Matryoshka model, so its "
                                 f"embeddings have its {hidden_size} dimensions only", "invalid_request", "dimensions")
        allowed = pooling.dimensions or range(1, hidden_size + 1)
        if dimensions not in allowed:
            said = f"1 to {hidden_size}" if not pooling.dimensions else ", ".join(map(str, pooling.dimensions))
            raise EngineRejected(f"dimensions {dimensions}: this model's embeddings may have {said}",
                                 "invalid_request", "dimensions")
    size = num_inputs * length * 4
    if size > MAX_BYTES:
        raise EngineRejected(f"{num_inputs} inputs x {length} dimensions come to {size / 2**20:.1f} MiB of "
                             f"float32 in one answer; the limit is {MAX_BYTES / 2**20:g} MiB: send at most "
                             f"{MAX_BYTES // (length * 4)} inputs a request", "invalid_request", "input")
    return length


@dataclass
class PoolPlan:
    """What one step pools: flat batch positions, and per pooling row its (batch row, first of its
    positions in `token_index`, how many, whether its sum starts again at this chunk)."""

    token_index: torch.Tensor  # [P]
    segments: list[tuple[int, int, int, bool]]

    def to(self, device: torch.device) -> PoolPlan:
        return PoolPlan(self.token_index.to(device, non_blocking=True), self.segments)


def plan_pooling(batch, starts: list[int], query_start: torch.Tensor) -> PoolPlan | None:
    """The positions this step pools, or None when no scheduled sequence is an embedding input."""
    index, segments = [], []
    for row, ((seq, num_new), start) in enumerate(zip(batch, starts)):
        if seq.embed is None:
            continue
        base = int(query_start[row])
        if seq.embed.mode == "mean":
            positions = range(base, base + num_new)
        elif start + num_new == seq.num_tokens:  # "last": the chunk that ends the input
            positions = range(base + num_new - 1, base + num_new)
        else:
            continue
        segments.append((row, len(index), len(positions), start == 0))
        index += positions
    if not segments:
        return None
    return PoolPlan(torch.tensor(index), segments)


@torch.inference_mode()
def pool(hidden: torch.Tensor, plan: PoolPlan) -> list[torch.Tensor]:
    """Per segment, the sum of its rows' states in float32, on the CPU."""
    rows = hidden[plan.token_index].float()
    sums = torch.stack([rows[first:first + count].sum(dim=0) for _, first, count, _ in plan.segments])
    return list(sums.cpu())


def collect(batch, plan: PoolPlan, sums: list[torch.Tensor]) -> None:
    """Add each segment's sum to its sequence's (Sequence.pooled), started again where it restarts."""
    for (row, _, _, restart), total in zip(plan.segments, sums):
        seq = batch[row][0]
        seq.pooled = total if restart or seq.pooled is None else seq.pooled + total


def vector(seq) -> bytes:
    """A finished input's vector as little-endian float32 bytes (what the reply carries, base64)."""
    embed, pooled = seq.embed, seq.pooled
    if pooled is None:
        raise RuntimeError("the input's prefill ended without its pooled state")
    v = pooled / seq.num_tokens if embed.mode == "mean" else pooled
    if embed.head is not None:
        weight, bias = embed.head
        v = torch.sigmoid(torch.dot(weight, v.float()) + bias).reshape(1)
    v = v[:embed.length]
    if embed.normalize:
        v = torch.nn.functional.normalize(v, p=2.0, dim=0)
    return v.to(torch.float32).numpy().astype("<f4", copy=False).tobytes()
