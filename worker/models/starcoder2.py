"""StarCoder 2 (Starcoder2ForCausalLM) on the Llama family's attention, linears and paged cache, with what
StarCoder 2 does differently, each as transformers computes it:

- LayerNorms with a weight and a bias (epsilon norm_epsilon) before each branch and at the end;
- q/k/v, o and the MLP biased (use_bias, on by default);
- a non-gated MLP, c_fc, GELU-tanh, c_proj (arcee.py's UngatedMLP, its up_proj and down_proj read
  from those names);
- a sliding window in every layer where the config has one; the head tied to the embeddings unless said.

On CPU in fp32 the native kernels do the attention's work, torch the LayerNorms and the MLP (OLMo 1's
split: the fused residual add + norm kernel computes RMSNorms).
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch.nn.functional as F
from torch import nn

from worker.models.arcee import UngatedMLP
from worker.models.config import ModelConfig
from worker.models.olmo import Olmo1CausalLM, Olmo1DecoderLayer
from worker.models.parallel import Piece, Shard

_NAMES = ((".mlp.up_proj.", ".mlp.c_fc."), (".mlp.down_proj.", ".mlp.c_proj."))  # ours, the checkpoint's


class Starcoder2DecoderLayer(Olmo1DecoderLayer):
    norm_class = nn.LayerNorm

    def __init__(self, cfg: ModelConfig, backend, shard: Shard, index: int):
        super().__init__(cfg, backend, shard, index)
        self.mlp = UngatedMLP(cfg, shard, partial(F.gelu, approximate="tanh"))


class Starcoder2CausalLM(Olmo1CausalLM):
    layer_class, norm_class = Starcoder2DecoderLayer, nn.LayerNorm

    def checkpoint_pieces(self, name: str) -> list[Piece]:
        pieces = super().checkpoint_pieces(name)
        for ours, theirs in _NAMES:
            pieces = [replace(p, name=p.name.replace(ours, theirs)) for p in pieces]
        return pieces
