"""Hunyuan dense (HunYuanDenseV1ForCausalLM: Hunyuan-0.5B to 7B) on the Llama family's layer, attention,
linears and paged cache, with what Hunyuan does differently, as transformers computes it:

- q and k RMS-normed per head after RoPE, not before (`Attention.norm_after_rope`), under the
  checkpoint's names query_layernorm and key_layernorm;
- its "dynamic" RoPE with an alpha is NTK by a fixed alpha, the same at every length: plain RoPE
  on the base rope_theta x alpha^(head_dim / (head_dim - 2)) (config.py reads it so).

On CPU in fp32 the native kernels run the layer as Llama's, the q/k norms in place after the rope.
"""
from __future__ import annotations

from dataclasses import replace

from worker.models.llama import CausalLM
from worker.models.parallel import Piece

_NAMES = ((".self_attn.q_norm.", ".self_attn.query_layernorm."), (".self_attn.k_norm.", ".self_attn.key_layernorm."))


class HunyuanCausalLM(CausalLM):
    def checkpoint_pieces(self, name: str) -> list[Piece]:
        pieces = super().checkpoint_pieces(name)
        for ours, theirs in _NAMES:
            pieces = [replace(p, name=p.name.replace(ours, theirs)) for p in pieces]
        return pieces
