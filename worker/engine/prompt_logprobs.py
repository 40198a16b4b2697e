"""Prompt log-probabilities (vLLM's `prompt_logprobs`): the log-softmax, at each prompt position, of
the raw logits that predicted it, computed in the prefill that runs anyway.

Which positions: position j's logits score prompt token j + 1, for tokens from the request's
`prompt_logprobs_start` on (Sequence.scored_span). How the prefix cache meets it: positions whose KV
comes from the cache produce no logits, so a scoring sequence takes cache hits only for blocks that
end before its first scored position (Sequence.cacheable_tokens); everything before is read from the
cache, the scored span is recomputed. A client that scores a continuation of a shared state (a
`select`) sets the start at the continuation and keeps the state's cache hits.

Bounded work: the logits are computed SLICE rows at a time (never a [tokens, vocab] tensor for a whole
chunk) and reduced on the device to the token's logprob, its rank and the top-k, k being at most the
request's prompt_logprobs (the engine bounds it by the vocabulary, the gateway by 20). Every
tensor-parallel rank computes the same slices (compute_logits is collective); rank 0 reduces them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.engine.types import TokenLogprob

SLICE = 256  # rows of logits alive at once


@dataclass
class PromptScoring:
    """What one step scores: flat batch indices of the scoring positions and, per index, the
    sequence's batch row and the prompt token it scores (on the CPU; indices go to the device)."""

    token_index: torch.Tensor  # [S] positions in the flattened batch
    targets: torch.Tensor  # [S] the prompt token each position scores
    owners: list[tuple[int, int]]  # (batch row, prompt position scored) per scoring position
    top_k: int  # the most top entries any scoring sequence asked for

    def to(self, device: torch.device) -> PromptScoring:
        return PromptScoring(self.token_index.to(device, non_blocking=True),
                             self.targets.to(device, non_blocking=True), self.owners, self.top_k)


def plan_scoring(batch, starts: list[int], query_start: torch.Tensor) -> PromptScoring | None:
    """The scoring positions of one step, or None when no scheduled sequence scores its prompt."""
    index, targets, owners, top_k = [], [], [], 0
    for row, ((seq, num_new), start) in enumerate(zip(batch, starts)):
        span = seq.scored_span(start, start + num_new)
        if not span:
            continue
        base = int(query_start[row]) - start
        index += [base + j for j in span]
        targets += [seq.prompt_ids[j + 1] for j in span]
        owners += [(row, j + 1) for j in span]
        top_k = max(top_k, seq.params.prompt_logprobs)
    if not index:
        return None
    return PromptScoring(torch.tensor(index), torch.tensor(targets), owners, top_k)


@torch.inference_mode()
def score(compute_logits, hidden: torch.Tensor, plan: PromptScoring, reduce: bool) -> tuple | None:
    """(logprob [S], rank [S], top values [S, k], top ids [S, k]) on the CPU where `reduce` (rank 0);
    every rank runs the slices, as `compute_logits` gathers whole rows on rank 0 alone."""
    parts = []
    for lo in range(0, plan.token_index.numel(), SLICE):
        logits = compute_logits(hidden[plan.token_index[lo:lo + SLICE]])
        if not reduce:
            continue
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(1, plan.targets[lo:lo + SLICE].unsqueeze(1))
        rank = (logprobs > chosen).sum(dim=-1) + 1
        top_vals, top_ids = logprobs.topk(min(plan.top_k, logprobs.shape[1]), dim=-1)
        parts.append((chosen.squeeze(1), rank, top_vals, top_ids))
    if not reduce:
        return None
    return tuple(torch.cat([p[i] for p in parts]).cpu() for i in range(4))


def collect(batch, plan: PromptScoring, scores: tuple) -> None:
    """File each score with its sequence (Sequence.prompt_scores, by prompt position)."""
    chosen, ranks, top_vals, top_ids = (t.tolist() for t in scores)
    for i, (row, position) in enumerate(plan.owners):
        seq = batch[row][0]
        if seq.prompt_scores is None:
            continue
        k = seq.params.prompt_logprobs
        seq.prompt_scores[position] = TokenLogprob(
            seq.prompt_ids[position], chosen[i], list(zip(top_ids[i][:k], top_vals[i][:k])), ranks[i])
