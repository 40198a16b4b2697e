"""The `triton` attention backend: paged-KV Triton kernels behind the AttentionBackend interface."""
from __future__ import annotations

import torch

from worker.engine.attention import AttentionMetadata
from worker.kernels import decode_attention, extend_attention, write_kv

MAX_KV_SPLITS = 16
MIN_SPLIT_TOKENS = 256  # shorter splits cost more in partial writes than they win in parallelism


def num_kv_splits(num_seqs: int, kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Enough (sequence, kv head, split) programs to fill every SM a few times over."""
    want = -(-4 * num_sms // max(1, num_seqs * kv_heads))
    by_length = -(-max_seq_len // MIN_SPLIT_TOKENS)
    return max(1, min(MAX_KV_SPLITS, want, by_length))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: any count is correct


class TritonAttentionBackend:
    """Decode-only steps use the split-K decode kernel; any step with a prefill row uses extend.

    Both read every key from the cache, so write_kv must run before attend in each layer. The decode
    path reads only tensor shapes and meta.max_seq_len on the host, so a CUDA graph captured with
    max_seq_len = the model's limit replays correctly for any shorter lengths.
    """

    name = "triton"

    def __init__(self, kv_splits: int | None = None):
        self.kv_splits = kv_splits  # None: chosen per step from the batch shape and the GPU
        self._sms: dict[torch.device, int] = {}

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_kv(k_cache, v_cache, key, value, slot_mapping)

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.is_decode_only:
            return decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    scale, num_kv_splits=self._splits(query, k_cache, meta))
        return extend_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, meta.max_query_len, scale)

    def _splits(self, query: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> int:
        if self.kv_splits is not None:
            return self.kv_splits
        if query.device not in self._sms:
            self._sms[query.device] = _num_sms(query.device)
        return num_kv_splits(query.shape[0], k_cache.shape[2], meta.max_seq_len,
                             self._sms[query.device])
