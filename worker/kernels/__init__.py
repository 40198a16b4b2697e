"""Triton kernels for the paged KV cache: write new K/V, decode attention, prefill/extend attention.

Runs on CUDA; on a CPU, only under Triton's interpreter (TRITON_INTERPRET=1 set before the first
`import triton`), which the kernel tests use.
"""
from worker.kernels.decode_attention import decode_attention
from worker.kernels.extend_attention import extend_attention
from worker.kernels.kv_write import write_kv

__all__ = ["decode_attention", "extend_attention", "write_kv"]
