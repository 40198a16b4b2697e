"""Top-k / top-p / min-p on a shortlist of each row's best tokens, not a sort of the whole vocabulary.

Sorting 151,936 logits per row (Qwen3) cost most of a sampler call. What these filters keep is always
a row's n best tokens for some n, so a `topk` shortlist sorted by value holds it: k + 1 entries for a
top-k row (the extra one shows whether equal logits straddle the cut), and for a top-p row without
top-k a width that grows GROWTH-fold until the cut falls inside it, up to the whole vocabulary (the
full path). Each entry's share of the mass is measured against the whole row's, so a partial
shortlist tells truthfully whether it has reached p.

The survivors are those of the former full sort (`sort` then cumsum), with two differences at the
edges. Where equal logits straddle a cut, the lowest token ids survive (the unstable sort kept an
arbitrary subset of them; the same filter with a stable sort keeps exactly these). And a top-p cut
without top-k is measured against the row's mass summed in float64: the former float32 softmax over
151,936 entries summed to about 1 + 3e-5, enough to move a 0.9 cut by a few tokens of ~1e-5 each.
"""
from __future__ import annotations

import torch

FIRST_WIDTH = 256  # a top-p row's first shortlist; most nuclei of real models fit in it
GROWTH = 8


def shortlist(
    logits: torch.Tensor, ks: list[int], ps: list[float], min_ps: list[float],
    first_width: int = FIRST_WIDTH,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, n] logits, best first, -inf where a filter dropped the entry, and their [B, n] token ids.

    `ks` are top-k values (0, -1 or >= vocab: off), `ps` top-p, `min_ps` min-p, one per row."""
    vocab = logits.shape[1]
    ks = [k if 0 < k < vocab else vocab for k in ks]
    widths = [k + 1 if k < vocab else first_width for k in ks]
    mass = _row_mass(logits, ks, vocab)
    found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    pending = list(range(len(ks)))
    while pending:
        idx = torch.tensor(pending, device=logits.device)
        width = min(vocab, max(widths[r] for r in pending))
        rows = take_rows(logits, pending)
        vals, ids = rows.topk(width, dim=-1)
        keep = _keep(vals, [ks[r] for r in pending], [ps[r] for r in pending],
                     [min_ps[r] for r in pending], mass[idx], vocab)
        _lowest_ids_at_ties(rows, vals, ids, keep)
        # the last entry out means every later one is out too; at full width there is nothing later
        done = [d or width == vocab for d in (~keep[:, -1]).tolist()]
        sel = torch.tensor(done, device=logits.device)
        found.append((idx[sel], vals[sel].masked_fill(~keep[sel], float("-inf")), ids[sel]))
        pending = [r for r, d in zip(pending, done) if not d]
        for r in pending:
            widths[r] = width * GROWTH
    return _assemble(found, len(ks), logits)


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows], without a copy when that is every row (advanced indexing of [B, 151936] is slow)."""
    if rows == list(range(t.shape[0])):
        return t
    return t.index_select(0, torch.tensor(rows, device=t.device))


def _row_mass(logits: torch.Tensor, ks: list[int], vocab: int) -> torch.Tensor:
    """Each row's sum of exp(logit - max) over the whole vocabulary: the yardstick for top-p on a
    partial shortlist (1 for top-k rows, whose shortlist holds everything the cut can keep)."""
    mass = torch.ones(len(ks), dtype=torch.float64, device=logits.device)
    open_rows = [r for r, k in enumerate(ks) if k == vocab]
    if open_rows:
        x = take_rows(logits, open_rows)
        mass[open_rows] = torch.exp(x - x.amax(dim=-1, keepdim=True)).sum(dim=-1, dtype=torch.float64)
    return mass


def _keep(vals: torch.Tensor, ks: list[int], ps: list[float], min_ps: list[float],
          mass: torch.Tensor, vocab: int) -> torch.Tensor:
    """Which shortlist entries survive top-k, then top-p over what is left, then min-p: the former
    full sort's arithmetic on its sorted prefix; the best entry always survives."""
    device = vals.device
    positions = torch.arange(vals.shape[1], device=device).unsqueeze(0)
    k = torch.tensor(ks, device=device).unsqueeze(1)
    in_k = positions < k
    masked = vals.masked_fill(~in_k, float("-inf"))
    probs = torch.softmax(masked, dim=-1)
    listed = torch.exp(masked - masked[:, :1]).sum(dim=-1, dtype=torch.float64)
    share = torch.where(k.squeeze(1) < vocab, torch.ones_like(mass), listed / mass)
    probs = probs * share.to(probs.dtype).unsqueeze(1)  # exactly 1 for top-k rows
    mass_before = probs.cumsum(dim=-1) - probs
    p = torch.tensor(ps, device=device).unsqueeze(1)
    keep = in_k & ~((mass_before > p) & (positions > 0))
    if any(m > 0.0 for m in min_ps):
        kept = torch.softmax(vals.masked_fill(~keep, float("-inf")), dim=-1)
        floor = torch.tensor(min_ps, device=device).unsqueeze(1) * kept[:, :1]
        keep &= ~(kept < floor)
    return keep


def _lowest_ids_at_ties(logits: torch.Tensor, vals: torch.Tensor, ids: torch.Tensor,
                        keep: torch.Tensor) -> None:
    """Where equal logits straddle a row's cut, the kept ones become the lowest ids among all the
    row's tokens of that value (topk's choice among equals is arbitrary). Rare in fp32 logits, common
    in bf16 ones; one pass over the row for each row where it happens."""
    width = vals.shape[1]
    n = keep.sum(dim=-1)
    last = vals.gather(1, (n - 1).clamp_min(0).unsqueeze(1)).squeeze(1)
    after = vals.gather(1, n.clamp_max(width - 1).unsqueeze(1)).squeeze(1)
    straddle = (n < width) & (last == after) & (last > float("-inf"))
    for j in straddle.nonzero().flatten().tolist():
        count = int(n[j])
        above = int((vals[j, :count] > last[j]).sum())
        tied = (logits[j] == last[j]).nonzero().flatten()
        ids[j, above:count] = tied[: count - above]


def _assemble(found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], batch: int,
              logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One [B, n] pair from the rounds' results, each cut after its last surviving entry."""
    parts = []
    for rows, vals, ids in found:
        if rows.numel():
            live = (vals > float("-inf")).any(dim=0).nonzero()
            width = int(live.max()) + 1 if live.numel() else 1
            parts.append((rows, vals[:, :width], ids[:, :width]))
    width = max(v.shape[1] for _, v, _ in parts)
    out_vals = torch.full((batch, width), float("-inf"), dtype=logits.dtype, device=logits.device)
    out_ids = torch.zeros((batch, width), dtype=torch.long, device=logits.device)
    for rows, vals, ids in parts:
        out_vals[rows, : vals.shape[1]] = vals
        out_ids[rows, : ids.shape[1]] = ids
    return out_vals, out_ids
