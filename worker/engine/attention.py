"""The attention backend interface: what the model runner hands an attention layer each step.

One flattened, unpadded batch per step: the new tokens of all scheduled sequences laid end to end.
Backends read past K/V straight from the paged cache through the block tables.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block_id * block_size + offset) per new token
    query_start_loc: torch.Tensor  # [B+1] int32: cumulative new-token counts; seq b owns [q[b], q[b+1])
    seq_lens: torch.Tensor  # [B] int32: context length after this step (cached + new tokens)
    block_tables: torch.Tensor  # [B, max_blocks] int32, rows padded with 0
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]  # host copies, so CPU backends can loop without syncs
    seq_lens_cpu: list[int]

    def to(self, device: torch.device) -> AttentionMetadata:
        """The device tensors moved (a no-op on the CPU); the host lists stay."""
        to = dict(device=device, non_blocking=True)
        return replace(self, slot_mapping=self.slot_mapping.to(**to), query_start_loc=self.query_start_loc.to(**to),
                       seq_lens=self.seq_lens.to(**to), block_tables=self.block_tables.to(**to))

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    name: str

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store new K/V ([T, Hkv, D]) into caches [num_blocks, block_size, Hkv, D] at slot_mapping."""
        ...

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
        """Causal attention of new queries [T, Hq, D] over each sequence's cached context (GQA);
        with a sliding `window`, a query at position p reads keys (p - window, p] only; with a
        `chunk` (Llama 4's chunked layers; never with a window), keys [p - p % chunk, p] only, its own
        chunk's; with `softcap` (Gemma 2) each score capped to softcap * tanh(score / softcap); with
        `sinks` [Hq] (gpt-oss) each head's sink logit in the softmax's denominator, a key with no value."""
        ...
