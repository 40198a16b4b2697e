"""The `triton` attention backend: paged-KV Triton kernels behind the AttentionBackend interface."""
from __future__ import annotations

import torch

from worker.engine.attention import AttentionMetadata
from worker.engine.kv_budget import cdiv
from worker.kernels import decode_attention, extend_attention, write_kv
from worker.kernels.extend_attention import extend_block_q

MAX_KV_SPLITS = 16
MIN_SPLIT_TOKENS = 256  # shorter splits cost more in partial writes than they win in parallelism
MAX_EXTEND_TILE = 64  # extend's block_m: (token, head) rows per program


def num_kv_splits(num_seqs: int, kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Enough (sequence, kv head, split) programs to fill every SM a few times over, rounded down to
    a power of two: each count is a kernel of its own, and five of them can all be built up front."""
    want = cdiv(4 * num_sms, max(1, num_seqs * kv_heads))
    by_length = cdiv(max_seq_len, MIN_SPLIT_TOKENS)
    splits = max(1, min(MAX_KV_SPLITS, want, by_length))
    return 1 << (splits.bit_length() - 1)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: any count is correct


class TritonAttentionBackend:
    """Decode-only steps use the split-K decode kernel; any step with a prefill row uses extend.

    Both read every key from the cache, so write_kv must run before attend in each layer. The decode
    path reads only tensor shapes and meta.max_seq_len on the host, so a CUDA graph captured with
    max_seq_len = the model's limit replays correctly for any shorter lengths. On a GPU the first
    attend of each shape launches every kernel variant a step can pick (`warm_up`), so no step
    after it waits for Triton to compile.
    """

    name = "triton"

    def __init__(self, kv_splits: int | None = None):
        self.kv_splits = kv_splits  # None: chosen per step from the batch shape and the GPU
        self._sms: dict[torch.device, int] = {}
        self._warm: set[tuple] = set()  # shapes and strides warm_up has run for

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_kv(k_cache, v_cache, key, value, slot_mapping)

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, window: int | None = None,
               softcap: float | None = None, sinks: torch.Tensor | None = None,
               chunk: int | None = None) -> torch.Tensor:
        if query.is_cuda and not torch.cuda.is_current_stream_capturing():
            self._warm_once(query, k_cache, v_cache, scale, softcap, sinks)
        if meta.is_decode_only:
            return decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    scale, num_kv_splits=self._splits(query, k_cache, meta), window=window,
                                    softcap=softcap, sinks=sinks, chunk=chunk)
        return extend_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, meta.max_query_len, scale, block_m=MAX_EXTEND_TILE,
                                window=window, softcap=softcap, sinks=sinks, chunk=chunk)

    def warm_up(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                scale: float, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> list[tuple[str, int]]:
        """Launch each decode split count and each extend tile height once, on one row of `query`
        over one token of block 0 (outputs thrown away, caches untouched). Triton specialises on
        these and on the tensors' dtypes, alignment and strides, which the real query and caches
        give here as in every step. Returns what it launched: ("decode", splits), ("extend", rows)."""
        row, device = query[:1], query.device
        tables = torch.zeros(1, 1, dtype=torch.int32, device=device)
        seq_lens = torch.ones(1, dtype=torch.int32, device=device)
        starts = torch.tensor([0, 1], dtype=torch.int32, device=device)
        launched = []
        for splits in self.split_choices():
            decode_attention(row, k_cache, v_cache, tables, seq_lens, scale, num_kv_splits=splits, softcap=softcap,
                             sinks=sinks)
            launched.append(("decode", splits))
        group = query.shape[1] // k_cache.shape[2]
        for max_query_len in powers_of_two(MAX_EXTEND_TILE):
            block_q = extend_block_q(group, max_query_len, MAX_EXTEND_TILE)
            if ("extend", block_q) not in launched:
                extend_attention(row, k_cache, v_cache, tables, seq_lens, starts, max_query_len, scale,
                                 block_m=MAX_EXTEND_TILE, softcap=softcap, sinks=sinks)
                launched.append(("extend", block_q))
        return launched

    def split_choices(self) -> list[int]:
        """Every split count `_splits` can return."""
        return [self.kv_splits] if self.kv_splits is not None else powers_of_two(MAX_KV_SPLITS)

    def _warm_once(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
        key = (query.dtype, query.shape[1:], query.stride(), k_cache.dtype, k_cache.shape[1:],
               k_cache.stride(), query.device, softcap, sinks is not None and sinks.dtype)
        if key not in self._warm:
            self._warm.add(key)
            self.warm_up(query, k_cache, v_cache, scale, softcap, sinks)

    def _splits(self, query: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> int:
        if self.kv_splits is not None:
            return self.kv_splits
        if query.device not in self._sms:
            self._sms[query.device] = _num_sms(query.device)
        return num_kv_splits(query.shape[0], k_cache.shape[2], meta.max_seq_len,
                             self._sms[query.device])


def powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]
