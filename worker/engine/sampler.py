"""Turns one step's logits into one token per row, vectorised over the batch.

Order per row: penalties -> min_tokens mask -> greedy argmax, or temperature -> top-k -> top-p
-> min-p -> exponential race (Gumbel-max). Logprobs come from the raw logits, as vLLM's default.
Seeded rows draw token i from a generator keyed by (seed, choice_index, i), so a request's tokens
do not depend on its batch-mates, on preemption, or on which worker runs it.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from worker.engine.types import SamplingParams, TokenLogprob


@dataclass
class SampleRow:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    choice_index: int = 0

    @property
    def step(self) -> int:
        return len(self.output_ids)


def draw_key(seed: int, choice_index: int, step: int) -> int:
    """A stable 63-bit generator seed; Python's hash() is not promised stable across versions."""
    digest = hashlib.blake2b(f"{seed}:{choice_index}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Sampler:
    def __init__(self, eos_token_ids: Iterable[int]):
        self.eos_token_ids = sorted(set(eos_token_ids))
        self._shared: dict[torch.device, torch.Generator] = {}

    def __call__(
        self, logits: torch.Tensor, rows: list[SampleRow]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        logits = logits.to(torch.float32, copy=True)  # masks below write in place
        raw_logprobs = self._raw_logprobs(logits, rows)
        logits = apply_penalties(logits, rows)
        logits = self._mask_early_stops(logits, rows)
        tokens = logits.argmax(dim=-1)
        sampled = [r for r, row in enumerate(rows) if not row.params.greedy]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            tokens[idx] = self._sample(logits[idx], [rows[r] for r in sampled])
        token_ids = tokens.tolist()
        return token_ids, _logprobs(raw_logprobs, token_ids, rows)

    def sample(
        self, logits: torch.Tensor, rows: list[SampleRow]
    ) -> tuple[list[int | Exception], list[TokenLogprob | None]]:
        """The batch at once; if that raises, row by row: the batched call cannot say whose row
        raised, and one request's bad value must not cost the others their token. A row that raises
        alone gets the exception in place of its token; the others keep theirs (greedy and seeded
        rows draw the same token either way, unseeded ones a fresh draw from the same distribution)."""
        try:
            return self(logits, rows)
        except Exception:
            tokens: list[int | Exception] = []
            logprobs: list[TokenLogprob | None] = []
            for r, row in enumerate(rows):
                try:
                    (token,), (logprob,) = self(logits[r:r + 1], [row])
                except Exception as exc:
                    token, logprob = exc, None
                tokens.append(token)
                logprobs.append(logprob)
            return tokens, logprobs

    @staticmethod
    def _raw_logprobs(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor | None:
        """Computed before any processing, and only when some row asked."""
        if all(row.params.logprobs is None for row in rows):
            return None
        return torch.log_softmax(logits, dim=-1)

    def _mask_early_stops(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Below min_tokens a row may not pick a token that would end it."""
        r_idx, t_idx = [], []
        for r, row in enumerate(rows):
            if row.step >= row.params.min_tokens:
                continue
            banned = list(row.params.stop_token_ids)
            if not row.params.ignore_eos:
                banned += self.eos_token_ids
            r_idx += [r] * len(banned)
            t_idx += banned
        if r_idx:
            dev = logits.device
            logits[torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        temps = torch.tensor([row.params.temperature for row in rows], device=logits.device)
        logits = filter_logits(logits / temps.unsqueeze(1), rows)
        probs = torch.softmax(logits, dim=-1)
        return (probs / self._exponentials(probs, rows)).argmax(dim=-1)

    def _exponentials(self, probs: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Exp(1) noise per row: argmax(p / q) is then a draw from p (the exponential race)."""
        q = torch.empty_like(probs).exponential_(generator=self._shared_generator(probs.device))
        vocab = probs.shape[1]
        for r, row in enumerate(rows):
            if row.params.seed is not None:
                key = draw_key(row.params.seed, row.choice_index, row.step)
                g = torch.Generator().manual_seed(key)
                q[r] = torch.empty(vocab).exponential_(generator=g).to(probs.device)
        return q.clamp_min_(1e-20)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._shared:
            self._shared[device] = torch.Generator(device=device)
            self._shared[device].seed()
        return self._shared[device]


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Repetition (HF, over prompt + output), then frequency and presence (OpenAI, over output)."""
    rep = [row.params.repetition_penalty for row in rows]
    if any(p != 1.0 for p in rep):
        ids = [row.prompt_ids + row.output_ids if p != 1.0 else [] for row, p in zip(rows, rep)]
        seen = _token_counts(ids, logits) > 0
        penalty = torch.tensor(rep, device=logits.device).unsqueeze(1)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    freq = [row.params.frequency_penalty for row in rows]
    pres = [row.params.presence_penalty for row in rows]
    if any(freq) or any(pres):
        counts = _token_counts(
            [row.output_ids if f or p else [] for row, f, p in zip(rows, freq, pres)], logits
        )
        logits = logits - torch.tensor(freq, device=logits.device).unsqueeze(1) * counts
        logits = logits - torch.tensor(pres, device=logits.device).unsqueeze(1) * (counts > 0)
    return logits


def _token_counts(id_lists: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
    """[B, V] occurrence counts of each row's ids."""
    counts = torch.zeros_like(logits)
    rows = torch.cat([torch.full((len(ids),), r) for r, ids in enumerate(id_lists)]).long()
    cols = torch.tensor([t for ids in id_lists for t in ids], dtype=torch.long)
    if cols.numel():
        ones = torch.ones(cols.numel(), device=logits.device)
        counts.index_put_((rows.to(logits.device), cols.to(logits.device)), ones, accumulate=True)
    return counts


def filter_logits(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Top-k, then top-p over what is left, then min-p; excluded tokens become -inf."""
    vocab = logits.shape[1]
    ks = [row.params.top_k if 0 < row.params.top_k < vocab else vocab for row in rows]
    ps = [row.params.top_p for row in rows]
    if any(k < vocab for k in ks) or any(p < 1.0 for p in ps):
        logits = _top_k_top_p(logits, ks, ps)
    min_ps = [row.params.min_p for row in rows]
    if any(m > 0.0 for m in min_ps):
        probs = torch.softmax(logits, dim=-1)
        scale = torch.tensor(min_ps, device=logits.device).unsqueeze(1)
        floor = scale * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def _top_k_top_p(logits: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """One descending sort serves both filters; the best token always survives."""
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor(ks, device=device).unsqueeze(1)
    positions = torch.arange(logits.shape[1], device=device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(positions >= k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    p = torch.tensor(ps, device=device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill((mass_before > p) & (positions > 0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def _logprobs(
    raw: torch.Tensor | None, token_ids: list[int], rows: list[SampleRow]
) -> list[TokenLogprob | None]:
    """The chosen token's raw logprob plus the top-N, with one host transfer for the batch."""
    if raw is None:
        return [None] * len(rows)
    want = [r for r, row in enumerate(rows) if row.params.logprobs is not None]
    idx = torch.tensor(want, device=raw.device)
    chosen = raw[idx, torch.tensor([token_ids[r] for r in want], device=raw.device)].tolist()
    n = max(rows[r].params.logprobs for r in want)
    top_vals, top_ids = raw[idx].topk(min(n, raw.shape[1]), dim=-1)
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out: list[TokenLogprob | None] = [None] * len(rows)
    for j, r in enumerate(want):
        k = rows[r].params.logprobs
        top = list(zip(top_ids[j][:k], top_vals[j][:k]))
        out[r] = TokenLogprob(token_ids[r], chosen[j], top)
    return out
