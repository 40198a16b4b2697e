"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter.

The switch is read when a kernel is decorated, so it must be set before worker.kernels is imported.
With TRITON_INTERPRET=0 and a GPU, the same tests run compiled on CUDA. Also here: builders for
paged batches and a plain-torch reference attention, handed to tests as fixtures.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from worker.engine.attention import AttentionMetadata  # noqa: E402

pytest.importorskip("triton")


@pytest.fixture
def device() -> str:
    if os.environ["TRITON_INTERPRET"] == "1" or not torch.cuda.is_available():
        return "cpu"
    return "cuda"


@pytest.fixture
def paged_batch():
    return make_batch


@pytest.fixture
def reference():
    return reference_attention


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, Hq, D] new tokens, laid end to end
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], whole context already written
    v_cache: torch.Tensor
    new_keys: torch.Tensor  # [T, Hkv, D] the new tokens' K/V (also in the caches)
    new_values: torch.Tensor
    meta: AttentionMetadata


def make_batch(seq_lens: list[int], query_lens: list[int], *, q_heads: int = 4,
               kv_heads: int = 2, head_dim: int = 16, block_size: int = 4, seed: int = 0,
               dtype: torch.dtype = torch.float32, device: str = "cpu") -> PagedBatch:
    """Random K/V for each sequence's whole context, scattered over shuffled cache blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks no sequence owns
    order = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq + [1])
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen)  # garbage in unused slots on purpose
    v_cache = torch.randn(shape, generator=gen)
    slots, new_k, new_v = [], [], []
    for b, (n, q) in enumerate(zip(seq_lens, query_lens)):
        owned = [order.pop() for _ in range(blocks_per_seq[b])]
        block_tables[b, :len(owned)] = torch.tensor(owned, dtype=torch.int32)
        keys = torch.randn(n, kv_heads, head_dim, generator=gen)
        values = torch.randn(n, kv_heads, head_dim, generator=gen)
        for pos in range(n):
            k_cache[owned[pos // block_size], pos % block_size] = keys[pos]
            v_cache[owned[pos // block_size], pos % block_size] = values[pos]
        slots += [owned[p // block_size] * block_size + p % block_size for p in range(n - q, n)]
        new_k.append(keys[n - q:])
        new_v.append(values[n - q:])
    query = torch.randn(sum(query_lens), q_heads, head_dim, generator=gen)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens),
    )

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)

    return PagedBatch(put(query), put(k_cache), put(v_cache), put(torch.cat(new_k)),
                      put(torch.cat(new_v)), meta)


def reference_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, window: int | None = None,
                        softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Gather each sequence's keys through its block table; causal softmax in fp32 (over keys
    (p - window, p] for a query at p, with a sliding window; of scores capped to
    softcap * tanh(score / softcap), with a soft-cap; each head's sink logit one more column of
    the softmax, dropped after it, with sinks [Hq])."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // kv_heads
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    for b, n in enumerate(meta.seq_lens_cpu):
        q0, q1 = starts[b], starts[b + 1]
        positions = torch.arange(n, device=query.device)
        blocks = meta.block_tables[b].long()[positions // block_size]
        keys = k_cache[blocks, positions % block_size].float().repeat_interleave(group, dim=1)
        values = v_cache[blocks, positions % block_size].float().repeat_interleave(group, dim=1)
        q = query[q0:q1].float()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(n - (q1 - q0), n, device=query.device)
        scores = scores.masked_fill(positions[None, None, :] > q_pos[None, :, None], float("-inf"))
        if window:
            scores = scores.masked_fill(positions[None, None, :] <= q_pos[None, :, None] - window, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            column = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
            probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
    return out
