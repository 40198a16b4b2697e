"""Phi-3.5-MoE (PhimoeForCausalLM) on the Llama family's attention, experts, linears and paged cache, with
what Phi-3.5-MoE does differently, each as transformers computes it:

- LayerNorms with a weight and a bias (epsilon rms_norm_eps) before each branch and at the end;
- q/k/v and o biased (attention_bias), the head too where lm_head_bias says;
- experts in every layer under Mixtral's checkpoint names, routed by sparsemixer (moe.py);
- LongRoPE's short factors with cos and sin x short_mscale, served up to the original context
  (config.py caps it there, as Phi-3's).

On CPU in fp32 the native kernels do the attention's work and each expert's SiLU x up, torch the
LayerNorms (OLMo 1's split: the fused residual add + norm kernel computes RMSNorms).
"""
from __future__ import annotations

from torch import nn

from worker.models.olmo import Olmo1CausalLM, Olmo1DecoderLayer


class PhimoeDecoderLayer(Olmo1DecoderLayer):
    norm_class = nn.LayerNorm


class PhimoeCausalLM(Olmo1CausalLM):
    layer_class, norm_class = PhimoeDecoderLayer, nn.LayerNorm
