"""Kernel 3: prefill/extend attention over the paged KV cache with a causal mask.

A sequence's new tokens are the last query_len positions of its seq_len-long context; the first
seq_len - query_len positions came from earlier steps or a prefix-cache hit. The new K/V are written
before attention runs, so every key is read from the cache the same way. One program covers
BLOCK_Q new tokens times all query heads of one kv head (GQA rows packed into the tile's M side),
so each K/V tile is loaded once per kv head, and a decode row (query_len 1) costs one small tile.
With a sliding window (window > 0) a row at position p reads keys (p - window, p] only; in a chunked
layer (chunk > 0, Llama 4's) keys [p - p % chunk, p], its own chunk's, each row from its own first key;
a tile starts at the first key its earliest row sees. A soft-cap (SOFTCAP > 0, Gemma 2's) caps each
score as the decode kernel does (`soft_cap`). With sinks (gpt-oss's, HAS_SINKS) each row's running
softmax starts from its head's sink logit, counted once in the denominator, with no value.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.decode_attention import soft_cap

LOG2E = 1.4426950408889634
NO_SCORE = tl.constexpr(-1.0e30)  # running max before any key: finite, so exp2 never sees inf - inf


# the table's width changes every step, a window or chunk per layer: one compile for all of them
@triton.jit(do_not_specialize=["stride_bt", "window", "chunk"])
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, sinks_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    window,  # > 0: a sliding window; 0: the whole context
    chunk,  # > 0: attention by chunks, each row within its own; 0: the whole context
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    KV_GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # keys already cached before this step's tokens

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + offs_m // GROUP_PAD  # new-token index within the sequence
    in_group = offs_m % GROUP_PAD
    heads = kv_head * KV_GROUP + in_group
    mask_m = (q_idx < q_len) & (in_group < KV_GROUP)
    q_pos = context_len + q_idx
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)

    if HAS_SINKS:  # the sink as a first key with no value: its logit (base 2) the running max, exp2(0) the sum
        m_i = tl.load(sinks_ptr + heads, mask=mask_m, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], NO_SCORE, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)  # last key any row sees + 1
    # each row's first key: its chunk's or its window's, key 0 for neither (2^30 past any position). No
    # branch: a branch per layer kind here made ptxas spill in the 32-row tiles (ops/gpu/compile_check.py)
    span = tl.where(chunk > 0, chunk, 1 << 30)
    reach = tl.where(window > 0, window, 1 << 30)
    row_first = tl.maximum(q_pos - q_pos % span, q_pos - reach + 1)
    first_pos = context_len + q_block * BLOCK_Q  # the tile's earliest row, which sees its earliest key
    kv_start = tl.maximum(tl.maximum(first_pos - first_pos % span, first_pos - reach + 1), 0)
    table = block_tables_ptr + seq * stride_bt
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        block = tl.load(table + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        in_block = offs_n % PAGE_SIZE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + block[:, None] * stride_kb + in_block[:, None] * stride_ks
                    + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP > 0:  # Gemma 2's: cap * tanh(score / cap)
            qk = soft_cap(qk, SOFTCAP)
        visible = (offs_n[None, :] >= row_first[:, None]) & (offs_n[None, :] <= q_pos[:, None])
        causal = visible & mask_n[None, :]
        qk = tl.where(causal, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + in_block[:, None] * stride_vs
                    + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def extend_block_q(kv_group: int, max_query_len: int, block_m: int = 64) -> int:
    """New tokens per program: block_m (token, head) rows, fewer for short queries (small tiles for
    decode rows), never under 16 rows (tl.dot's minimum). Always a power of two from a short list:
    each value is a kernel of its own, compiled on first use."""
    group_pad = triton.next_power_of_2(kv_group)
    block_q = max(1, block_m // group_pad)
    block_q = min(block_q, triton.next_power_of_2(max(1, max_query_len)))
    return max(block_q, triton.cdiv(16, group_pad))


def extend_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                     block_m: int = 64, block_n: int = 64,
                     out: torch.Tensor | None = None, window: int | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None,
                     chunk: int | None = None) -> torch.Tensor:
    """Causal attention of a flattened batch of new tokens (query [T, Hq, D]) over paged contexts
    (within a sliding `window`, or each row's own `chunk`, with one; soft-capped scores with a
    `softcap`; each head's sink logit in its softmax's denominator, with `sinks` [Hq]).

    Sequence b owns query rows [query_start_loc[b], query_start_loc[b+1]) and has seq_lens[b] keys
    in the cache, this step's included. block_m is the tile height in (token, head) rows.
    """
    num_tokens, q_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    assert q_heads % kv_heads == 0, "query heads must be a multiple of kv heads"
    assert query.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    kv_group = q_heads // kv_heads
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if query.element_size() > 2:
        block_n = min(block_n, 32)  # fp32 tiles of 64 overflow the register file
    group_pad = triton.next_power_of_2(kv_group)
    block_q = extend_block_q(kv_group, max_query_len, block_m)
    _extend_kernel[(num_seqs, kv_heads, triton.cdiv(max_query_len, block_q))](
        query, k_cache, v_cache, out,
        block_tables, seq_lens, query_start_loc, sinks if sinks is not None else seq_lens,  # unread without
        scale * LOG2E, window or 0, chunk or 0,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        PAGE_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        KV_GROUP=kv_group, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",  # fp32 stays fp32
        SOFTCAP=float(softcap or 0.0), HAS_SINKS=sinks is not None,
        num_warps=4 if block_q * group_pad <= 64 else 8, num_stages=2,
    )
    return out
