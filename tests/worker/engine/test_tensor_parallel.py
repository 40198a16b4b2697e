"""Tensor parallelism on CPU (gloo, two real processes): TP = 2 is token-exact with TP = 1 and with
transformers on tiny Llama (GQA, 2 KV heads, an odd vocabulary), Qwen2 (1 KV head: replicated),
Qwen3 (per-head q/k norm), Phi-3 (q/k/v and gate/up fused in the checkpoint), Gemma 3 (sliding
layers past their window), Mixtral and Qwen2-MoE (experts split, a shared expert), OLMo 2 and OLMoE
(q and k normed across heads the ranks split), gpt-oss (sinks split with their heads, experts stored
fused), GLM-4-0414 (RoPE on half of each head, by adjacent pairs), Command R+ (q and k LayerNormed per
head, each head its own weights), GLM-4.5 (a grouped sigmoid router, shared experts), Granite 3 MoE
(experts stored as one tensor, a shared MLP), Phi-3.5-MoE (sparsemixer, a biased head) and DeepSeek-V3 and
V2 (latent attention: its latent projections whole on each rank, q, kv_b and o split by heads), StableLM 2
(q and k LayerNormed per head, one checkpoint tensor a head; parallel residuals), Hunyuan (q/k norms
after RoPE), Apertus (xIELU's scalars on each rank) and Llama 4 (experts stored fused, their inputs
scaled; NoPE layers' queries scaled by position), with the prefix cache, preemption and seeded sampling
as at TP = 1."""
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.worker.engine.test_model_families import with_norms_drawn
from worker.engine.llm import LLM
from worker.engine.types import SamplingParams
from worker.models.config import read_model_config
from worker.models.parallel import check_shardable

torch.set_num_threads(1)
MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
SEEDED = [SamplingParams(max_tokens=MAX_NEW, temperature=1.0, top_p=0.9, seed=100 + i) for i in range(4)]
SMALL = dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128)
MODELS = {  # name: (arch, overrides)
    "llama-gqa2-odd-vocab": ("llama", dict(num_kv_heads=2, vocab_size=2047)),
    "qwen2-one-kv-head": ("qwen2", dict(num_kv_heads=1)),
    "qwen3-gqa2": ("qwen3", dict(num_kv_heads=2, head_dim=32)),
    "phi3-fused-checkpoint": ("phi3", dict(num_kv_heads=2)),  # each rank slices qkv_proj / gate_up_proj
    "gemma3-sliding": ("gemma3", dict(num_kv_heads=2, head_dim=16, tie_word_embeddings=True, config_extra=dict(
        sliding_window=16, sliding_window_pattern=2, query_pre_attn_scalar=16, final_logit_softcapping=30.0))),
    # each rank a slice of every expert (Mixtral's w1/w3 rows, w2 columns), one all-reduce a layer
    "mixtral-experts": ("mixtral", dict(num_kv_heads=2, config_extra=dict(num_local_experts=4, num_experts_per_tok=2))),
    "qwen2-moe-shared-expert": ("qwen2_moe", dict(num_kv_heads=2, config_extra=dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48))),
    # q and k normed across all heads: each rank's sums of squares all-reduced (the one KV head on both)
    "olmo2-one-kv-head": ("olmo2", dict(num_kv_heads=1)),
    "olmoe-clipped-experts": ("olmoe", dict(num_kv_heads=2, config_extra=dict(
        num_experts=4, num_experts_per_tok=2, clip_qkv=0.3))),
    # each rank its heads' sinks (drawn N(0, 1) by initializer_range) and a run of every expert's
    # interleaved gate/up pairs, the down bias once
    "gpt-oss-sinks-and-experts": ("gpt_oss", dict(num_kv_heads=2, head_dim=16, config_extra=dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=16, swiglu_limit=0.5, initializer_range=1.0))),
    # each rank reorders its own heads' q and k rows for the pairwise RoPE; gate/up stored fused
    "glm4-pairwise-half-rotary": ("glm4", dict(num_kv_heads=2, head_dim=32)),
    # each rank its heads' rows of the [heads, head_dim] q/k norms (drawn N(0, 0.08), like the linears)
    "cohere-per-head-qk-norms": ("cohere", dict(num_kv_heads=2, config_extra=dict(use_qk_norm=True))),
    # the grouped sigmoid router (and its correction bias) whole on each rank, the shared experts split
    "glm4-moe-grouped-router-shared-experts": ("glm4_moe", dict(num_kv_heads=2, head_dim=16, config_extra=dict(
        n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, moe_intermediate_size=32,
        routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True))),
    # each rank its rows of every expert's gate and up out of the one [experts, 2 x width, hidden] tensor
    "granitemoe-shared-experts-in-one-tensor": ("granitemoeshared", dict(num_kv_heads=2, config_extra=dict(
        num_local_experts=4, intermediate_size=32, shared_intermediate_size=48, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=6.0))),
    # the head's bias split with its vocabulary rows (an odd vocabulary: a padding row), LayerNorms whole
    "phimoe-sparsemixer-head-bias": ("phimoe", dict(num_kv_heads=2, vocab_size=2047, config_extra=dict(
        num_local_experts=4, intermediate_size=32, attention_bias=True, lm_head_bias=True, router_jitter_noise=0.3))),
    # the latent's projections and norms whole on each rank, q_b_proj / kv_b_proj rows and o_proj columns
    # by heads, each rank's q and k_pe rows reordered for the pairwise RoPE; K 24 wide and V 16 in the cache
    "deepseek-v3-latent-attention-grouped-router": ("deepseek_v3", dict(num_kv_heads=4, config_extra=dict(
        kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
        num_experts_per_tok=3, n_group=4, topk_group=2, moe_intermediate_size=32, first_k_dense_replace=1))),
    # q_proj split by heads, V wider than K (q and k padded), the group-limited softmax router
    "deepseek-v2-q-proj-wide-v": ("deepseek_v2", dict(num_kv_heads=4, config_extra=dict(
        kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=32, n_routed_experts=8,
        num_experts_per_tok=2, topk_method="group_limited_greedy", n_group=4, topk_group=2, moe_intermediate_size=32,
        n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=1.5, attention_bias=True))),
    # each rank its heads' q/k LayerNorms (one checkpoint tensor a head), its rows of the q/k/v biases, the
    # quarter of each head rotated; attention and MLP side by side, biased LayerNorms whole
    "stablelm-per-head-layernorms-parallel": ("stablelm", dict(num_kv_heads=2, config_extra=dict(
        qk_layernorm=True, use_parallel_residual=True, use_qkv_bias=True))),
    # each rank its heads' q/k norms, after their RoPE (NTK by a fixed alpha)
    "hunyuan-norms-after-rope": ("hunyuan_v1_dense", dict(num_kv_heads=2, head_dim=16, config_extra=dict(
        attention_bias=True, rope_scaling={"type": "dynamic", "alpha": 1000.0, "factor": 1.0}))),
    # up's rows and down's columns split, xIELU's two scalars (drawn) whole on each rank
    "apertus-xielu": ("apertus", dict(num_kv_heads=2, config_extra=dict(attention_bias=True))),
    # each rank its columns of gate's and up's out of [experts, hidden, 2 x width], its rows of down's, the
    # shared expert split, the router whole; a dense rotated layer (weightless q/k norms) attending by chunks of 8
    # (the prompts cross several), then a sparse NoPE one
    "llama4-fused-experts-nope": ("llama4", dict(num_kv_heads=2, head_dim=16, intermediate_size=32, config_extra=dict(
        intermediate_size_mlp=128, num_local_experts=4, interleave_moe_layer_step=2, no_rope_layers=[1, 0],
        attention_chunk_size=8, floor_scale=4, attn_scale=0.3))),
}
# norms drawn around 1, biases around 0 (transformers builds 1 and 0)
DRAWN = {"phimoe-sparsemixer-head-bias", "deepseek-v3-latent-attention-grouped-router", "deepseek-v2-q-proj-wide-v",
         "stablelm-per-head-layernorms-parallel", "hunyuan-norms-after-rope",
         "apertus-xielu"}


@dataclass
class Case:
    model_dir: Path
    prompts: list[list[int]]
    expected: list[list[int]]  # transformers' greedy tokens


@pytest.fixture(scope="module", params=list(MODELS))
def case(request, build_tiny, random_prompts, hf_greedy) -> Case:
    arch, overrides = MODELS[request.param]
    model_dir = build_tiny(f"tp-{request.param}", arch, **{**SMALL, **overrides})
    if request.param in DRAWN:
        with_norms_drawn(model_dir, seed=17, mean=1.0)
    prompts = random_prompts(6, 3, 40, seed=2)
    return Case(model_dir, prompts, hf_greedy(model_dir, prompts, MAX_NEW))


@pytest.fixture(scope="module")
def llama_dir(build_tiny) -> Path:
    arch, overrides = MODELS["llama-gqa2-odd-vocab"]
    return build_tiny("tp-llama-gqa2-odd-vocab", arch, **{**SMALL, **overrides})


def tokens(results) -> list[list[int]]:
    return [r.token_ids for r in results]


def test_tp2_matches_tp1_and_transformers_greedy_cached_and_seeded(case):
    tp1 = LLM(case.model_dir)
    seeded_tp1 = tokens(tp1.generate(case.prompts[:4], SEEDED))
    assert tokens(tp1.generate(case.prompts, GREEDY)) == case.expected
    with LLM(case.model_dir, tensor_parallel_size=2) as tp2:
        assert tokens(tp2.generate(case.prompts, GREEDY)) == case.expected
        hits = tp2.engine.stats()["prefix_cache_hits"]
        assert tokens(tp2.generate(case.prompts, GREEDY)) == case.expected  # from the prefix cache
        stats = tp2.engine.stats()
        assert stats["prefix_cache_hits"] > hits
        assert stats["num_free_blocks"] == stats["num_blocks"]
        assert tokens(tp2.generate(case.prompts[:4], SEEDED)) == seeded_tp1


def test_each_rank_holds_half_the_weights_and_its_share_of_the_kv(llama_dir):
    model_dir = llama_dir
    # the ranks keep the row-major default; alone, the probe may choose a padded layout (a packed or
    # paneled weight is larger) by timing, so the whole model is held to the same layout here
    whole = LLM(model_dir, num_blocks=32, cpu_linear_kernel="onednn").engine.runner.rank_memory
    with LLM(model_dir, num_blocks=32, tensor_parallel_size=2) as tp2:
        ranks = tp2.engine.runner.rank_memory
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:  # norms are replicated and the vocabulary padded: a little over half
        assert 0.5 * whole[0]["weight_bytes"] <= r["weight_bytes"] < 0.52 * whole[0]["weight_bytes"]
        assert r["kv_bytes"] == whole[0]["kv_bytes"] // 2  # 1 of 2 KV heads, the same 32 blocks


def test_forced_preemption_at_tp2_stays_exact(llama_dir, random_prompts, hf_greedy):
    model_dir = llama_dir
    prompts = random_prompts(6, 3, 40, seed=2)
    with LLM(model_dir, tensor_parallel_size=2, num_blocks=8, block_size=8, max_num_batched_tokens=64) as tp2:
        assert tokens(tp2.generate(prompts, GREEDY)) == hf_greedy(model_dir, prompts, MAX_NEW)
        assert tp2.engine.stats()["num_preemptions"] > 0


def test_a_model_that_does_not_split_is_refused_before_any_rank_starts(llama_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide the model's attention heads \(4\)"):
        check_shardable(read_model_config(llama_dir), 3)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide"):
        LLM(llama_dir, tensor_parallel_size=3)


def test_structured_outputs_at_tp2_are_those_of_tp1(tiny_model_dir):
    """The grammar masks the logits on rank 0, where the sampler runs: with the same seeds, TP = 2
    writes exactly TP = 1's constrained tokens, and they match."""
    import json
    import re

    from shared.sampling import StructuredOutputs
    schema = {"type": "object", "additionalProperties": False, "required": ["n", "ok"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                             "ok": {"type": "boolean"}}}
    regex = r"[0-9]{3}-[a-z]{2,4}"
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s,
                             structured_outputs=StructuredOutputs(json=json.dumps(schema)))
              for s in range(3)]
    params += [SamplingParams(max_tokens=20, temperature=1.0, seed=s,
                              structured_outputs=StructuredOutputs(regex=regex)) for s in range(3)]
    prompts = [[5, 17, 301, 42, 999, 7]] * len(params)
    tp1 = LLM(tiny_model_dir).generate(prompts, params)
    with LLM(tiny_model_dir, tensor_parallel_size=2) as tp2:
        got = tp2.generate(prompts, params)
    assert tokens(got) == tokens(tp1)
    for r in got[:3]:
        assert set(json.loads(r.text)) == {"n", "ok"}
    for r in got[3:]:
        assert re.fullmatch(regex, r.text), r.text
