"""Kernel 1: scatter this step's new K/V rows into the paged cache by slot mapping."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_d < HEAD_DIM) & (slot >= 0)  # slot -1 marks a padding token (CUDA-graph batches)

    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + offs_d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + offs_d, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + head * stride_kch + offs_d
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + head * stride_vch + offs_d
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store key/value [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D]; slots < 0 are skipped."""
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "head_dim must be contiguous"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache head_dim must be contiguous"
    _write_kv_kernel[(num_tokens, kv_heads)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        PAGE_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1 if head_dim <= 128 else 2,
    )
