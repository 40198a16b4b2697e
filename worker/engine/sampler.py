"""Turns one step's logits into one token per row, vectorised over the batch.

Order per row: penalties -> logit_bias -> grammar mask -> min_tokens mask -> greedy argmax, or temperature -> top-k
-> top-p -> min-p -> a draw. Top-k and top-p work on a shortlist of the row's best tokens (shortlist.py), never
a sort of the whole vocabulary. Logprobs come from the raw logits, as vLLM's default.
Seeded rows draw token i by an exponential race with noise from a generator keyed by
(seed, choice_index, i), so a request's tokens do not depend on its batch-mates, on preemption, or on
which worker runs it; unseeded rows need only the right distribution and take the cheaper draw.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from worker.engine.constraint import Constraint
from worker.engine.cpu_native import CpuKernels
from worker.engine.logit_rules import GrammarMasks, HeldTensors, apply_logit_bias
from worker.engine.shortlist import shortlist, take_rows
from worker.engine.types import SamplingParams, TokenLogprob


@dataclass
class SampleRow:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    choice_index: int = 0
    constraint: Constraint | None = None  # the choice's grammar state, when it has one

    @property
    def step(self) -> int:
        return len(self.output_ids)


def draw_key(seed: int, choice_index: int, step: int) -> int:
    """A stable 63-bit generator seed; Python's hash() is not promised stable across versions."""
    digest = hashlib.blake2b(f"{seed}:{choice_index}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Sampler:
    def __init__(self, eos_token_ids: Iterable[int], cpu_kernels: CpuKernels | None = None):
        self.eos_token_ids = sorted(set(eos_token_ids))
        self._cpu_kernels = cpu_kernels  # their argmax: torch's runs single-threaded on CPU
        self._shared: dict[torch.device, torch.Generator] = {}
        self._grammar_masks = GrammarMasks()

    def __call__(
        self, logits: torch.Tensor, rows: list[SampleRow]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        if all(_plain_greedy(row) for row in rows):  # nothing edits the logits: skip the copy and masks
            return self._argmax(logits).tolist(), [None] * len(rows)
        logits = logits.to(torch.float32, copy=True)  # masks below write in place
        raw_logprobs = self._raw_logprobs(logits, rows)
        logits = apply_penalties(logits, rows)
        logits = apply_logit_bias(logits, rows)
        logits = self._grammar_masks(logits, rows)  # first: a dead end is the grammar's alone
        logits = self._mask_early_stops(logits, rows)
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy = [r for r, row in enumerate(rows) if row.params.greedy]
        sampled = [r for r, row in enumerate(rows) if not row.params.greedy]
        if greedy:
            tokens[torch.tensor(greedy, device=logits.device)] = self._argmax(take_rows(logits, greedy))
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            tokens[idx] = self._sample(take_rows(logits, sampled), [rows[r] for r in sampled])
        token_ids = tokens.tolist()
        return token_ids, _logprobs(raw_logprobs, token_ids, rows)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if self._cpu_kernels is not None and self._cpu_kernels.usable(logits):
            return self._cpu_kernels.argmax(logits)
        return logits.argmax(dim=-1)

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
        """Below min_tokens a row may not pick a token that would end it (a stop id; EOS unless
        ignored). A row its grammar holds keeps them where the grammar allows nothing else: a structure
        complete before min_tokens ends there (its EOS), and a stop id the grammar requires is written
        as text (check_finish), rather than the row be left no token at all."""
        r_idx, t_idx, held = [], [], []
        for r, row in enumerate(rows):
            if row.step >= row.params.min_tokens:
                continue
            banned = list(row.params.stop_token_ids)
            if not row.params.ignore_eos:
                banned += self.eos_token_ids
            r_idx += [r] * len(banned)
            t_idx += banned
            if banned and row.constraint is not None and row.constraint.active:
                held.append(r)
        if not r_idx:
            return logits
        dev = logits.device
        rs, ts = torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)
        before = logits[rs, ts] if held else None  # a copy: the banned logits, to give back
        logits[rs, ts] = float("-inf")
        if held:
            held_rows = torch.tensor(held, device=dev)
            closed = held_rows[~(logits.index_select(0, held_rows) > float("-inf")).any(dim=1)]
            if closed.numel():
                back = torch.isin(rs, closed)
                logits[rs[back], ts[back]] = before[back]
        return logits

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Rows that filter by rank (top-k, top-p) draw from their shortlist; the others from the
        whole vocabulary, min-p being a floor that needs no sort."""
        temps = torch.tensor([row.params.temperature for row in rows], device=logits.device)
        logits = logits / temps.unsqueeze(1)
        vocab = logits.shape[1]
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        ranked = [r for r, row in enumerate(rows) if _filters_by_rank(row.params, vocab)]
        whole = [r for r, row in enumerate(rows) if not _filters_by_rank(row.params, vocab)]
        if ranked:
            idx, params = torch.tensor(ranked, device=logits.device), [rows[r].params for r in ranked]
            vals, ids = shortlist(take_rows(logits, ranked), [p.top_k for p in params],
                                  [p.top_p for p in params], [p.min_p for p in params])
            tokens[idx] = self._draw(vals, ids, [rows[r] for r in ranked], vocab)
        if whole:
            idx = torch.tensor(whole, device=logits.device)
            floored = min_p_floor(take_rows(logits, whole), [rows[r].params.min_p for r in whole])
            tokens[idx] = self._draw(floored, None, [rows[r] for r in whole], vocab)
        return tokens

    def _draw(self, logits: torch.Tensor, ids: torch.Tensor | None, rows: list[SampleRow],
              vocab: int) -> torch.Tensor:
        """One token per row from softmax(logits); `ids` names each column's token (None: the
        columns are the vocabulary). Seeded rows run the exponential race, unseeded ones invert the
        cumulative mass with the shared generator (one random number per row, not per token)."""
        probs = torch.softmax(logits, dim=-1)
        picks = torch.empty(len(rows), dtype=torch.long, device=probs.device)
        seeded = [j for j, row in enumerate(rows) if row.params.seed is not None]
        shared = [j for j, row in enumerate(rows) if row.params.seed is None]
        if seeded:
            idx = torch.tensor(seeded, device=probs.device)
            q = self._seeded_noise([rows[j] for j in seeded], None if ids is None else ids[idx], vocab)
            picks[idx] = (probs[idx] / q.to(probs.device)).argmax(dim=-1)
        if shared:
            idx = torch.tensor(shared, device=probs.device)
            picks[idx] = _invert_cdf(probs[idx], self._shared_generator(probs.device))
        return picks if ids is None else ids.gather(1, picks.unsqueeze(1)).squeeze(1)

    @staticmethod
    def _seeded_noise(rows: list[SampleRow], ids: torch.Tensor | None, vocab: int) -> torch.Tensor:
        """Exp(1) noise per row: argmax(p / q) is then a draw from p (the exponential race).

        Same tokens as the former full-sort sampler for the same seed: q is still drawn over the whole
        vocabulary, in the same order, from the (seed, choice, step) generator, then read at the
        shortlisted ids; the tokens left out had p = 0 in the former race, so its argmax is among
        them. A token differs only where the survivors do (ties at a cut, a top-p cut within float
        rounding: see shortlist.py) and a token at that edge wins the race."""
        cols = None if ids is None else ids.cpu()
        qs = []
        for j, row in enumerate(rows):
            g = torch.Generator().manual_seed(draw_key(row.params.seed, row.choice_index, row.step))
            q = torch.empty(vocab).exponential_(generator=g)
            qs.append(q if cols is None else q[cols[j]])
        return torch.stack(qs).clamp_min_(1e-20)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._shared:
            self._shared[device] = torch.Generator(device=device)
            self._shared[device].seed()
        return self._shared[device]


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Repetition (HF, over prompt + output), then frequency and presence (OpenAI, over output).

    Applied where the ids are, as transformers' processors do (gather, edit, scatter back), not
    over every row's whole vocabulary: torch.where over [rows, vocab] ran ~1 ms a pass on the CPU,
    and the ids became a tensor in one call each (a prompt's once), never id by id in Python; 16
    rows of 2,500 tokens were ~13 ms of every step. Same arithmetic on the same values, so the same
    logits: an id listed twice is edited from the same original value twice and written twice."""
    rep = [row.params.repetition_penalty for row in rows]
    freq = [row.params.frequency_penalty for row in rows]
    pres = [row.params.presence_penalty for row in rows]
    use_rep = any(p != 1.0 for p in rep)
    if not use_rep and not any(freq) and not any(pres):
        return logits
    logits = logits.clone()
    dev = logits.device
    if use_rep:
        r, c = _positions([(row.prompt_ids, row.output_ids) if p != 1.0 else None for row, p in zip(rows, rep)], dev)
        if r.numel():
            penalty = torch.tensor(rep, device=dev, dtype=logits.dtype)[r]
            picked = logits[r, c]
            logits[r, c] = torch.where(picked > 0, picked / penalty, picked * penalty)
    if any(freq) or any(pres):
        r, c = _positions([((), row.output_ids) if f or p else None for row, f, p in zip(rows, freq, pres)], dev)
        if r.numel():
            counts = torch.zeros_like(logits)
            counts.index_put_((r, c), torch.ones(r.numel(), device=dev, dtype=logits.dtype), accumulate=True)
            n = counts[r, c]
            picked = logits[r, c] - torch.tensor(freq, device=dev, dtype=logits.dtype)[r] * n
            logits[r, c] = picked - torch.tensor(pres, device=dev, dtype=logits.dtype)[r] * (n > 0)
    return logits


def _positions(rows_ids: list[tuple[list[int], list[int]] | None],
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, ids) of every id of each row's (prompt ids, output ids), repeats kept; None: none of
    that row's. A prompt's tensor is made once (_prompt_tensor)."""
    parts = []
    for r, ids in enumerate(rows_ids):
        if ids is None:
            continue
        prompt, output = ids
        if prompt:
            parts.append((r, _prompt_tensor(prompt)[0]))
        if output:
            parts.append((r, torch.tensor(output, dtype=torch.long)))
    if not parts:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return empty, empty
    rows = torch.cat([torch.full((t.numel(),), r, dtype=torch.long) for r, t in parts])
    return rows.to(device), torch.cat([t for _, t in parts]).to(device)


# a prompt's ids as a tensor, made once (its list may grow when a sequence is resumed: made again);
# ~1M ids held at most (~45 MB with their lists)
_prompt_tensor = HeldTensors(lambda ids: (torch.tensor(ids, dtype=torch.long),), 1 << 20,
                             fresh=lambda ids, made: made[0].numel() == len(ids))


def _plain_greedy(row: SampleRow) -> bool:
    """Greedy with nothing that would change the row's logits or ask for its logprobs."""
    p = row.params
    return (p.greedy and p.logprobs is None and p.repetition_penalty == 1.0 and not p.frequency_penalty
            and not p.presence_penalty and not p.logit_bias and row.step >= p.min_tokens
            and (row.constraint is None or not row.constraint.active))


def _filters_by_rank(params: SamplingParams, vocab: int) -> bool:
    return 0 < params.top_k < vocab or params.top_p < 1.0


def min_p_floor(logits: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """min-p over the whole vocabulary: tokens below min_p times the best one's probability become
    -inf; a floor on the row's best, no sort."""
    if not any(m > 0.0 for m in min_ps):
        return logits
    probs = torch.softmax(logits, dim=-1)
    floor = torch.tensor(min_ps, device=logits.device).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < floor, float("-inf"))


INVERT_BLOCK = 128  # columns per block of the two-level draw
TWO_LEVEL_FROM = 1 << 16  # rows x columns from which the two-level draw is the cheaper (measured: _invert_cdf)


def _invert_cdf(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A column per row drawn from probs: one uniform against the running mass, kept in float64 so
    the smallest probabilities keep their share. A large batch takes two levels (`_two_level`):
    one float64 scan of every row costs ~2 ns a value on CPU, and far more once its buffer is
    large enough to be mapped afresh on every call (64 rows of a 2,048-token vocabulary: 0.7-1.3
    ms), where the two levels cost a float32 sum over the rows plus ~150 us of fixed work (AMD
    EPYC: 64 x 2,048 in 0.17-0.33 ms, 8 x 151,936 in 0.33 ms against 2 ms)."""
    rows, width = probs.shape
    if rows * width >= TWO_LEVEL_FROM:
        return _two_level(probs, generator)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    u = _uniform_below(cdf[:, -1:], generator)
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


def _uniform_below(total: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A uniform in [0, total) per row; raises for a row with no mass (its logits NaN, or none finite)."""
    if not bool((total > 0).all()):  # False for NaN too
        raise ValueError("a row's probabilities are not finite: its logits hold NaN or no finite value")
    u = torch.rand(total.shape, dtype=torch.float64, generator=generator, device=total.device) * total
    return torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # rounding never reaches total


def _two_level(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The row cut into blocks of INVERT_BLOCK columns: a block chosen by the blocks' running mass
    (each block summed in float32, the sums run in float64), then a column by the block's own
    running mass in float64. Where a block's float32 sum and its float64 scan differ in the last
    bits, a draw past the scan's end falls on the block's last column that has mass."""
    rows, width = probs.shape
    blocks = -(-width // INVERT_BLOCK)
    if width % INVERT_BLOCK:
        probs = torch.nn.functional.pad(probs, (0, blocks * INVERT_BLOCK - width))
    tiles = probs.reshape(rows, blocks, INVERT_BLOCK)
    sums = tiles.sum(dim=-1).double()
    mass = sums.cumsum(dim=-1)  # [rows, blocks]
    u = _uniform_below(mass[:, -1:], generator)
    block = torch.searchsorted(mass, u, right=True)  # [rows, 1]: u < total, so a block with mass
    before = (mass - sums).gather(1, block)  # the mass before the block
    tile = tiles.gather(1, block.unsqueeze(-1).expand(rows, 1, INVERT_BLOCK)).squeeze(1)
    column = torch.searchsorted(tile.cumsum(dim=-1, dtype=torch.float64), (u - before).clamp_(min=0),
                                right=True)
    last_with_mass = torch.where(tile > 0, torch.arange(INVERT_BLOCK, device=probs.device), -1)
    return (block * INVERT_BLOCK + torch.minimum(column, last_with_mass.amax(dim=-1, keepdim=True))).squeeze(1)


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
