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


def apply_grammar_masks(logits: torch.Tensor, rows) -> torch.Tensor:
    """Tokens the grammar forbids become -inf, for every constrained row in one op: one bitmask is
    allocated for the step, each active matcher fills its row, xgrammar applies the rows listed."""
    constrained = [r for r, row in enumerate(rows) if row.constraint is not None and row.constraint.active]
    if not constrained:
        return logits
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
    for r in constrained:
        rows[r].constraint.fill(bitmask, r)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    indices=constrained)
    return logits
