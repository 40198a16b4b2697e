"""Per-request edits of a step's logits, each one vectorised over the rows that asked for it and
leaving the other rows' logits untouched (so a free row samples exactly as in a batch without
constrained ones): logit_bias, then the grammar's token bitmask."""
from __future__ import annotations

from collections.abc import Callable

import torch

from worker.engine.structured import CODE, PARAM
from worker.engine.types import EngineRejected


def apply_logit_bias(logits: torch.Tensor, rows) -> torch.Tensor:
    """OpenAI's logit_bias: the bias added to the given ids' logits, one scatter for the batch. Each
    request's ids and biases become tensors once (_bias_of), not entry by entry every step (16
    choices of 300 biases were ~2.5 ms of Python a step)."""
    parts = [(r, _bias_of(row.params)) for r, row in enumerate(rows) if row.params.logit_bias]
    if parts:
        dev = logits.device
        rows_idx = torch.cat([torch.full((len(ids),), r, dtype=torch.long) for r, (ids, _) in parts])
        ids = torch.cat([ids for _, (ids, _) in parts])
        values = torch.cat([values for _, (_, values) in parts])
        logits.index_put_((rows_idx.to(dev), ids.to(dev)), values.to(dev, logits.dtype), accumulate=True)
    return logits


class HeldTensors:
    """Tensors made once per object (a request's params, a prompt's ids) and found again by the
    object's identity, the object held so that its id stays its own; `fresh` says whether what was
    made still fits the object. Past `budget` elements held, all are let go."""

    def __init__(self, make: Callable, budget: int, fresh: Callable | None = None):
        self._make, self._budget, self._fresh = make, budget, fresh
        self._held: dict[int, tuple] = {}
        self._size = 0

    def __call__(self, obj):
        found = self._held.get(id(obj))
        if found is None or found[0] is not obj or (self._fresh and not self._fresh(obj, found[1])):
            made = self._make(obj)
            size = sum(t.numel() for t in made)
            if self._size + size > self._budget:
                self._held.clear()
                self._size = 0
            found = self._held[id(obj)] = (obj, made)
            self._size += size
        return found[1]


# a request's logit_bias as (ids, biases); ~300k biases held at most (~25 MB with their params)
_bias_of = HeldTensors(lambda params: (
    torch.tensor([int(t) for t in params.logit_bias], dtype=torch.long),
    torch.tensor([float(v) for v in params.logit_bias.values()], dtype=torch.float32)), 300 * 1024)


class GrammarMasks:
    """Tokens the grammar forbids become -inf, for every constrained row in one op: each active
    matcher fills its row of one bitmask, and xgrammar applies the rows listed. The bitmask is kept
    between steps (allocating it cost a fifth of the op): a filled row is written whole, and rows
    not listed are never read. A grammar that leaves a row no token at all (a pattern that can
    match nothing, `[^\\s\\S]`, or nothing past a prefix) is the request's to answer for: a 400 that
    names it, raised for the batch and, row by row (Sampler.sample), for its row alone."""

    def __init__(self):
        self._bitmask = None

    def __call__(self, logits: torch.Tensor, rows) -> torch.Tensor:
        constrained = [r for r, row in enumerate(rows) if row.constraint is not None and row.constraint.active]
        if not constrained:
            return logits
        import xgrammar as xgr

        bitmask = self._rows(len(rows), logits.shape[1])
        for r in constrained:
            rows[r].constraint.fill(bitmask, r)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        indices=constrained)
        idx = torch.tensor(constrained, device=logits.device)
        open_rows = (logits.index_select(0, idx) > float("-inf")).any(dim=1).tolist()
        if not all(open_rows):
            row = rows[constrained[open_rows.index(False)]]
            raise EngineRejected(f"the structured_outputs grammar leaves no token to write after {row.step} tokens "
                                 "of output: it can match nothing from there (an empty character class or range, a "
                                 "schema no value satisfies)", CODE, PARAM)
        return logits

    def _rows(self, n: int, vocab: int) -> torch.Tensor:
        import xgrammar as xgr

        words = xgr.get_bitmask_shape(1, vocab)[1]
        if self._bitmask is None or self._bitmask.shape[0] < n or self._bitmask.shape[1] != words:
            self._bitmask = xgr.allocate_token_bitmask(max(n, 64), vocab)
        return self._bitmask[:n]
