"""Kernel 2: decode attention (one new token per sequence) over the paged KV cache.

Flash-decoding: each sequence's context is cut into NUM_SPLITS equal parts, one program per
(sequence, kv head, split) computes a partial softmax over its part for all query heads that share
the kv head (GQA), and a second kernel merges the partials by their log-sum-exp. A sequence's split
length is computed in the kernel from its own length, so ragged batches stay balanced and the grid
depends only on tensor shapes (a captured CUDA graph stays valid for any lengths). With a sliding
window (window > 0) the splits cover the last `window` keys only; in a chunked layer (chunk > 0,
Llama 4's) the new token's chunk only, from key (seq_len - 1) // chunk * chunk on. With a soft-cap
(Gemma 2's SOFTCAP > 0) each score becomes SOFTCAP * tanh(score / SOFTCAP) before the softmax. With sinks
(gpt-oss's learned logit per head, HAS_SINKS) the merge counts each head's sink once in the
softmax's denominator, as a key with no value.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
EMPTY_LSE = tl.constexpr(-1.0e30)  # log-sum-exp of a split that saw no keys: weight 0 in the merge, never NaN


@triton.jit
def soft_cap(qk, SOFTCAP: tl.constexpr):
    """Scores in base-2 units (x log2(e)) soft-capped as cap * tanh(score / cap) in natural units,
    tanh(x) = 1 - 2 / (exp(2x) + 1) (exp's overflow gives 1, its underflow -1: no NaN)."""
    x = qk / (1.4426950408889634 * SOFTCAP)
    return (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * (SOFTCAP * 1.4426950408889634)


# the table's width changes every step, a window or chunk per layer: one compile for all of them
@triton.jit(do_not_specialize=["stride_bt", "window", "chunk"])
def _decode_partial_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    window,  # > 0: a sliding window, the last `window` keys; 0: the whole context
    chunk,  # > 0: attention by chunks, the new token's chunk only; 0: the whole context
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_pot, stride_poh, stride_pos,
    stride_plt, stride_plh,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    KV_GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    if chunk > 0:  # the chunk of the new token at seq_len - 1 (a padding row's 0 reads none)
        first = tl.maximum(seq_len - 1, 0) // chunk * chunk
    split_len = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_H)
    heads = kv_head * KV_GROUP + offs_g
    mask_h = offs_g < KV_GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], EMPTY_LSE, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        block = tl.load(table + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        in_block = offs_n % PAGE_SIZE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + block[:, None] * stride_kb + in_block[:, None] * stride_ks
                    + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP > 0:
            qk = soft_cap(qk, SOFTCAP)
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + in_block[:, None] * stride_vs
                    + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), EMPTY_LSE)
    tl.store(part_out_ptr + seq * stride_pot + heads[:, None] * stride_poh + split * stride_pos
             + offs_d[None, :], out, mask=mask_h[:, None] & mask_d[None, :])
    tl.store(part_lse_ptr + seq * stride_plt + heads * stride_plh + split, lse, mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, sinks_ptr,
    stride_pot, stride_poh, stride_pos,
    stride_plt, stride_plh,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + seq * stride_plt + head * stride_plh + offs_s,
                  mask=mask_s, other=float("-inf"))
    top = tl.max(lse, 0)
    if HAS_SINKS:  # the sink's logit, in the partials' base-2 units
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink)
    weight = tl.exp2(lse - top)
    parts = tl.load(part_out_ptr + seq * stride_pot + head * stride_poh
                    + offs_s[:, None] * stride_pos + offs_d[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    total = tl.sum(weight, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - top)
    out = tl.sum(parts * weight[:, None], 0) / total
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=mask_d)


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     num_kv_splits: int = 1, block_n: int = 64, num_stages: int = 2,
                     out: torch.Tensor | None = None, window: int | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None,
                     chunk: int | None = None) -> torch.Tensor:
    """Attention of one query token per sequence (query [B, Hq, D]) over its paged context (its
    last `window` keys, with a sliding window; its own chunk's keys, with a `chunk`; scores
    soft-capped with a `softcap`; each head's sink logit in its softmax's denominator, with `sinks` [Hq]).

    seq_lens[b] counts the whole context including the new token, whose K/V are already written.
    A sequence of length 0 (a padding row) gets zeros.
    """
    num_seqs, q_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    assert q_heads % kv_heads == 0, "query heads must be a multiple of kv heads"
    assert query.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    kv_group = q_heads // kv_heads
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    part_out = torch.empty((num_seqs, q_heads, num_kv_splits, head_dim), dtype=torch.float32,
                           device=query.device)
    part_lse = torch.empty((num_seqs, q_heads, num_kv_splits), dtype=torch.float32,
                           device=query.device)
    block_d = triton.next_power_of_2(head_dim)
    _decode_partial_kernel[(num_seqs, kv_heads, num_kv_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse,
        scale * LOG2E, window or 0, chunk or 0,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        PAGE_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        KV_GROUP=kv_group, NUM_SPLITS=num_kv_splits,
        BLOCK_H=max(16, triton.next_power_of_2(kv_group)),  # tl.dot needs M >= 16
        BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",  # fp32 stays fp32
        SOFTCAP=float(softcap or 0.0), num_warps=4, num_stages=num_stages,
    )
    _decode_merge_kernel[(num_seqs, q_heads)](
        part_out, part_lse, out, sinks if sinks is not None else part_lse,  # unread without sinks
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, NUM_SPLITS=num_kv_splits,
        BLOCK_S=triton.next_power_of_2(num_kv_splits), BLOCK_D=block_d, HAS_SINKS=sinks is not None,
        num_warps=4 if block_d >= 128 else 2,
    )
    return out
