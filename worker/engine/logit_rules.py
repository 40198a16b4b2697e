"""Per-request edits of a step's logits, each one vectorised over the rows that asked for it and
leaving the other rows' logits untouched (so a free row samples exactly as in a batch without
constrained ones): logit_bias, then the grammar's token bitmask."""
from __future__ import annotations

import torch


def apply_logit_bias(logits: torch.Tensor, rows) -> torch.Tensor:
    """OpenAI's logit_bias: the bias added to the given ids' logits, one scatter for the batch."""
    r_idx, t_idx, values = [], [], []
    for r, row in enumerate(rows):
        for token, bias in (row.params.logit_bias or {}).items():
            r_idx.append(r)
            t_idx.append(int(token))
            values.append(float(bias))
    if r_idx:
        dev = logits.device
        logits.index_put_((torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)),
                          torch.tensor(values, device=dev, dtype=logits.dtype), accumulate=True)
    return logits


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
