"""OLMo 2 and OLMo 3 (Olmo2ForCausalLM, Olmo3ForCausalLM) on the Llama family's attention, linears and
paged cache, with what OLMo does differently, each as transformers computes it:

- no norm before a branch: the attention's and the MLP's outputs are RMS-normed, then added;
- q and k each RMS-normed across all their heads at once (one norm over q_size, one over kv_size);
- the norms multiply by their weight in fp32 and cast the product (Llama's cast first);
- OLMo 3: three sliding layers to one full, the sliding ones on an unscaled RoPE of their own
  (the full ones on the config's, YaRN in the long-context releases).

OLMo 1 (OlmoForCausalLM) is Llama's layer with LayerNorms that have no weight, q, k and v clipped
where the config says. EXAONE 4 (Exaone4ForCausalLM) is OLMo 2's layer with Llama's norms (cast, then
multiplied by the weight), q and k normed per head, and, where the config has a window, three sliding
layers to one full, only the sliding ones rotated (the full ones have no position encoding).

On CPU in fp32 the native kernels do the attention's work (GEMMs, the whole-width q/k norms, rope,
decode attention) and SiLU x up; the norms around the branches stay torch's (the fused residual
add + norm kernel computes Llama's order, norm after the add, not OLMo's; and RMSNorm, not OLMo 1's
LayerNorm).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.config import ModelConfig
from worker.models.llama import MLP, Attention, CausalLM, DecoderLayer, RMSNorm
from worker.models.parallel import Shard


class OlmoRMSNorm(RMSNorm):
    cast_last = True


class OlmoDecoderLayer(nn.Module):
    norm_class: type[nn.Module] = OlmoRMSNorm  # every norm's, q's and k's too (EXAONE 4's: Llama's)

    def __init__(self, cfg: ModelConfig, backend, shard: Shard, index: int):
        super().__init__()
        self.local_rope = cfg.local_rope(index)
        rope = cfg.rope_layers is None or cfg.rope_layers[index]  # EXAONE 4's full layers: unrotated
        self.self_attn = Attention(cfg, backend, shard, cfg.layer_windows[index], rope, norm=self.norm_class)
        self.mlp = MLP(cfg, shard)
        self.post_attention_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, rope, kv_cache, meta):
        h = h + self.post_attention_layernorm(self.self_attn(h, rope, kv_cache, meta))
        return h + self.post_feedforward_layernorm(self.mlp(h))

    def forward_fused(self, h, positions, table, kv_cache, meta, ops):
        h = h + self.post_attention_layernorm(self.self_attn.forward_fused(h, positions, table, kv_cache, meta, ops))
        return h + self.post_feedforward_layernorm(self.mlp.forward_fused(h, ops))


class OlmoCausalLM(CausalLM):
    layer_class, norm_class = OlmoDecoderLayer, OlmoRMSNorm

    def _forward_fused(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        h = self._embed(input_ids)
        tables = self._rope_tables_for(positions, h.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h = layer.forward_fused(h, positions, tables[layer.local_rope], kv_cache, meta, self.cpu_kernels)
        return self.model.norm(h)


class Exaone4DecoderLayer(OlmoDecoderLayer):
    norm_class = RMSNorm


class Exaone4CausalLM(OlmoCausalLM):
    layer_class, norm_class = Exaone4DecoderLayer, RMSNorm


class OlmoLayerNorm(nn.Module):
    """OLMo 1's: a LayerNorm without weight or bias, in fp32, its epsilon 1e-5 whatever the config says."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.shape = (dim,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.shape, None, None, eps=1e-5).to(x.dtype)


class Olmo1DecoderLayer(DecoderLayer):
    norm_class = OlmoLayerNorm

    def forward_fused(self, h, positions, table, kv_cache, meta, ops):
        h = h + self.self_attn.forward_fused(self.input_layernorm(h), positions, table, kv_cache, meta, ops)
        return h + self.mlp.forward_fused(self.post_attention_layernorm(h), ops)


class Olmo1CausalLM(OlmoCausalLM):
    layer_class, norm_class = Olmo1DecoderLayer, OlmoLayerNorm
