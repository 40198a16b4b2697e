"""Per-request edits of a step's logits, each one vectorised over the rows that asked for it and
leaving the other rows' logits untouched (so a free row samples exactly as in a batch without
constrained ones): logit_bias, then the grammar's token bitmask."""
from __future__ import annotations

import torch


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


_BIASES: dict[int, tuple] = {}  # id(params) -> (params, ids, values): the params held, so the id stays theirs
_BIASES_KEPT = 4096


def _bias_of(params) -> tuple[torch.Tensor, torch.Tensor]:
    found = _BIASES.get(id(params))
    if found is None or found[0] is not params:
        if len(_BIASES) >= _BIASES_KEPT:
            _BIASES.clear()
        bias = params.logit_bias
        found = _BIASES[id(params)] = (params, torch.tensor([int(t) for t in bias], dtype=torch.long),
                                       torch.tensor([float(v) for v in bias.values()], dtype=torch.float32))
    return found[1], found[2]


class GrammarMasks:
    """Tokens the grammar forbids become -inf, for every constrained row in one op: each active
    matcher fills its row of one bitmask, and xgrammar applies the rows listed. The bitmask is kept
    between steps (allocating it cost a fifth of the op): a filled row is written whole, and rows
    not listed are never read."""

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
        return logits

    def _rows(self, n: int, vocab: int) -> torch.Tensor:
        import xgrammar as xgr

        words = xgr.get_bitmask_shape(1, vocab)[1]
        if self._bitmask is None or self._bitmask.shape[0] < n or self._bitmask.shape[1] != words:
            self._bitmask = xgr.allocate_token_bitmask(max(n, 64), vocab)
        return self._bitmask[:n]
