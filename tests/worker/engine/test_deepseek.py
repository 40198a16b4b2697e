"""DeepSeek-V2 and V3 (multi-head latent attention: K's heads wider than V's, or narrower, in one paged
cache; q through a low-rank bottleneck or not; RoPE by adjacent pairs or by halves; YaRN with DeepSeek's
mscale on the scores) with their routers (V3: grouped sigmoid with a correction bias; V2: a softmax's
top k, greedy or within the best groups), shared experts and dense first layers, are token-exact with
transformers' greedy on the native and the torch paths, prefilled in chunks and from the prefix cache,
their top-5 logprobs too (1e-5); the Triton kernels (interpreted) with a head size that is no power of
two; what transformers' modules would not compute is refused when the folder is read, by name."""

import pytest
import torch

from tests.worker.engine.test_model_families import (GREEDY, assert_top5_logprobs_match, exact_on_cpu_paths,
                                                     rewritten, tokens, with_norms_drawn)
from tests.worker.engine.test_moe_families import with_mtp_layer
from worker.engine.llm import LLM
from worker.models.config import read_model_config
from worker.models.deepseek import softmax_scale

torch.set_num_threads(1)
MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)  # K 24 wide, V 16
# DeepSeek-V3's shape of YaRN (mscale != mscale_all_dim here, so both the cos/sin factor and the scores' show)
YARN = dict(rope_type="yarn", rope_theta=10_000.0, factor=4.0, original_max_position_embeddings=32, beta_fast=32,
            beta_slow=1, mscale=0.8, mscale_all_dim=1.0)
YARN_V2 = {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}  # V2's: cos and sin unscaled, the scores scaled
DEEPSEEK = {  # name: (arch, config fields); hidden 64, 4 heads, 3 layers
    # every router part in play: 8 experts in 4 groups of 2, the 3 chosen from the best 2, renormalised, x 2.5
    "v3-q-lora-yarn": ("deepseek_v3", dict(
        MLA, q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        rope_parameters=YARN)),
    # q straight from q_proj, RoPE by halves, biased latent projections and o, not renormalised, 2 dense layers
    "v3-plain-by-halves": ("deepseek_v3", dict(
        MLA, q_lora_rank=None, rope_interleave=False, attention_bias=True, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=2,
        routed_scaling_factor=1.5, norm_topk_prob=False)),
    # DeepSeek-V2's group-limited greedy: 8 experts in 4 groups, the 3 from the best 2, x 1.5
    "v2-group-limited-yarn": ("deepseek_v2", dict(
        MLA, q_lora_rank=None, topk_method="group_limited_greedy", n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1,
        routed_scaling_factor=1.5, rope_parameters=YARN_V2)),
    # V2-Lite's greedy with q through the bottleneck; V wider than K (32 > 24: q and k padded), biased attention
    "v2-greedy-wide-v": ("deepseek_v2", dict(
        MLA, v_head_dim=32, q_lora_rank=48, topk_method="greedy", n_routed_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.0,
        attention_bias=True)),
}


def deepseek_dir(name: str, build_tiny):
    """The case's folder, its norms' weights drawn around 1 and its biases around 0 (transformers
    builds them 1 and 0), so a latent norm or a bias read into the wrong place shows."""
    arch, extra = DEEPSEEK[name]
    folder = build_tiny(f"deepseek-{name}", arch, num_layers=3, num_kv_heads=4, config_extra=extra)
    return with_norms_drawn(folder, seed=19, mean=1.0)


@pytest.mark.parametrize("name", list(DEEPSEEK))
def test_deepseek_matches_transformers(name, build_tiny, random_prompts, hf_greedy):
    folder = deepseek_dir(name, build_tiny)
    prompts = random_prompts(4, 20, 90, seed=71)  # past YaRN's original context (32), in chunks of 32
    expected = hf_greedy(folder, prompts, 16)
    llm = exact_on_cpu_paths(folder, prompts, expected)
    assert_top5_logprobs_match(llm, folder, prompts[0])


def test_the_triton_kernels_serve_a_head_size_that_is_no_power_of_two(build_tiny, random_prompts, hf_greedy):
    """K's heads 24 wide (V's 16, padded): the interpreted Triton kernels mask the head past 24 of 32."""
    folder = deepseek_dir("v3-q-lora-yarn", build_tiny)
    assert read_model_config(folder).head_dim == 24
    prompts = random_prompts(2, 20, 60, seed=73)
    llm = LLM(folder, attention_backend="triton", max_num_batched_tokens=32)
    assert tokens(llm.generate(prompts, GREEDY)) == hf_greedy(folder, prompts, 16)


def test_deepseek_configs_read_as_transformers_builds_them(tmp_path, build_tiny):
    """The head sizes, RoPE's layout, the scores' scale and the routing as transformers' config classes
    fill them in; a released V3 folder's spelling (transformers 4's: rope_scaling "type" "yarn",
    rope_theta top level, no head_dim, an MTP layer counted) reads the same."""
    from safetensors import safe_open
    from transformers import AutoConfig

    v3 = deepseek_dir("v3-q-lora-yarn", build_tiny)
    cfg = read_model_config(v3)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rotary_dim, cfg.rope_interleaved) == (24, 4, 8, True)
    assert (cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank, cfg.mla.v_head_dim) == (48, 32, 16)
    assert (cfg.moe.routing, cfg.moe.groups, cfg.moe.scaling, cfg.moe.top_k) == ("grouped_sigmoid", (4, 2), 2.5, 3)
    assert cfg.moe.sparse_layers == (False, True, True) and cfg.moe.shared_intermediate_size == 32
    mscale = 0.1 * 1.0 * torch.log(torch.tensor(4.0)).item() + 1.0
    assert softmax_scale(cfg) == pytest.approx(24 ** -0.5 * mscale ** 2)
    with safe_open(v3 / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").abs().min() > 0
    released = rewritten(v3, tmp_path / "released", rope_parameters=None, rope_theta=10_000.0, head_dim=None,
                         qk_head_dim=None, dtype=None, torch_dtype="float32", num_nextn_predict_layers=1,
                         topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1,
                         rope_scaling={"type": "yarn", **{k: v for k, v in YARN.items()
                                                          if k not in ("rope_type", "rope_theta")}})
    assert read_model_config(released) == cfg
    plain = read_model_config(deepseek_dir("v3-plain-by-halves", build_tiny))
    assert (plain.mla.q_lora_rank, plain.rope_interleaved, plain.qkv_bias, plain.o_bias) == (None, False, True, True)
    assert softmax_scale(plain) == 24 ** -0.5
    v2 = read_model_config(deepseek_dir("v2-group-limited-yarn", build_tiny))
    assert (v2.moe.routing, v2.moe.groups, v2.moe.norm_topk_prob, v2.rope_interleaved) == (
        "group_limited_softmax", (4, 2), False, True)
    wide = read_model_config(deepseek_dir("v2-greedy-wide-v", build_tiny))
    assert (wide.head_dim, wide.moe.groups, wide.qkv_bias) == (32, (1, 1), True)
    for name in DEEPSEEK:
        folder = deepseek_dir(name, build_tiny)
        ours, theirs = read_model_config(folder), AutoConfig.from_pretrained(folder)
        assert ours.moe.sparse_layers == tuple(i >= theirs.first_k_dense_replace for i in range(3))
        assert ours.moe.shared_intermediate_size == theirs.moe_intermediate_size * theirs.n_shared_experts
        assert ours.moe.scaling == theirs.routed_scaling_factor and ours.moe.top_k == theirs.num_experts_per_tok
        assert ours.mla.qk_head_dim == theirs.qk_head_dim and ours.rotary_dim == theirs.head_dim


@pytest.mark.parametrize("name,changes,message", [
    # (V3's FP8 release is read as every block-scaled FP8 folder: test_fp8_checkpoint.py)
    ("v2-greedy-wide-v", dict(mlp_bias=True), "mlp_bias True in config.json is not supported for a deepseek_v2"),
    ("v3-q-lora-yarn", dict(n_group=3), "n_group 3 and topk_group 2 in config.json: a deepseek_v3 folder's router"),
    ("v3-q-lora-yarn", dict(n_group=8, topk_group=1), "n_group 8 .*groups of 2 or more"),
    ("v3-q-lora-yarn", dict(topk_group=1), "its 3 experts a row within topk_group"),
    ("v3-q-lora-yarn", dict(moe_layer_freq=2), "moe_layer_freq 2 in config.json: a deepseek_v3 folder is served"),
    ("v2-group-limited-yarn", dict(norm_topk_prob=True), "norm_topk_prob True in config.json: a deepseek_v2 folder"),
    ("v2-group-limited-yarn", dict(topk_method="noaux_tc"), "topk_method 'noaux_tc' in config.json"),
    ("v2-group-limited-yarn", dict(n_group=16), "n_group 16 and topk_group 2 .*deepseek_v2"),
])
def test_what_deepseeks_modules_would_not_compute_is_refused_by_name(name, changes, message, tmp_path, build_tiny):
    with pytest.raises(ValueError, match=message):
        read_model_config(rewritten(deepseek_dir(name, build_tiny), tmp_path / "bad", **changes))


def test_v3_mtp_layers_in_the_checkpoint_are_not_read(tmp_path, build_tiny, random_prompts):
    """A released V3 folder holds its MTP layer past num_hidden_layers (model.layers.61.* of 61) in a
    shard of its own: it serves as without."""
    folder = deepseek_dir("v3-q-lora-yarn", build_tiny)
    mtp = with_mtp_layer(folder, tmp_path / "with-mtp")
    prompts = random_prompts(3, 20, 60, seed=79)
    assert tokens(LLM(mtp).generate(prompts, GREEDY)) == tokens(LLM(folder).generate(prompts, GREEDY))


def test_the_routers_stay_fp32_in_a_bf16_model(build_tiny, random_prompts):
    """transformers keeps V3's router weight and correction bias, and V2's router weight, in fp32."""
    for name in ("v3-q-lora-yarn", "v2-group-limited-yarn"):
        llm = LLM(deepseek_dir(name, build_tiny), dtype="bfloat16")
        gate = llm.engine.runner.model.model.layers[1].mlp.gate
        assert gate.weight.dtype == torch.float32
        assert getattr(gate, "e_score_correction_bias", gate.weight).dtype == torch.float32
        [result] = llm.generate(random_prompts(1, 20, 40, seed=83), GREEDY)
        assert len(result.token_ids) > 0
