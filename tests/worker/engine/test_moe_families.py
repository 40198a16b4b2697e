"""Mixtures of experts routed otherwise than by a softmax's top k: GLM-4.5 (sigmoid scores, a correction
bias for choosing only, the best groups first, shared experts, dense first layers, half of each head
rotated), Granite 3 MoE (Granite's four scalars, a softmax over the top k's logits, experts stored as one
tensor; a shared MLP in the Shared variant) and Phi-3.5-MoE (sparsemixer, LayerNorms with biases, a biased
head, LongRoPE with its own scale) are token-exact with transformers' greedy, on the native and the torch
paths, prefilled in chunks and from the prefix cache, and their routing's weights through the top-5
logprobs (1e-5); what their routers cannot do is refused when the folder is read, by name."""
import json
import shutil

import pytest
import torch

from tests.worker.engine.test_model_families import (GREEDY, assert_top5_logprobs_match, exact_on_cpu_paths,
                                                     rewritten, tokens, with_norms_drawn)
from worker.engine.llm import LLM
from worker.models.config import read_model_config

torch.set_num_threads(1)
# GLM-4.5's router with every part in play: 8 experts in 4 groups of 2, the 3 chosen from the best 2
# groups, weights renormalised and x 2.5; the correction bias drawn by build_model_dir
GLM45 = dict(n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, moe_intermediate_size=32,
             n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, use_qk_norm=True,
             attention_bias=True)
# GLM-4.5-Air's choices (no q/k norms, no q/k/v bias) and the other branches: weights not renormalised,
# two shared experts, two dense layers, a quarter of each head rotated
GLM45_AIR = dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
                 n_shared_experts=2, first_k_dense_replace=2, routed_scaling_factor=1.5, norm_topk_prob=False,
                 rope_parameters=dict(rope_type="default", rope_theta=10_000.0, partial_rotary_factor=0.25))
GRANITE = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=6.0)
# sparsemixer's threshold wide enough that most rows' softmax has more than the one pick in it
PHIMOE = dict(num_local_experts=6, intermediate_size=32, attention_bias=True, lm_head_bias=True,
              router_jitter_noise=0.3)
LONGROPE = dict(rope_type="longrope", short_factor=[1.0 + 0.25 * i for i in range(8)],
                long_factor=[4.0 + i for i in range(8)], short_mscale=1.3, long_mscale=1.6,
                original_max_position_embeddings=64)
MOE = {  # name: (arch, build_tiny overrides); hidden 64, 4 heads of 16 (2 KV), 3 layers
    "glm-4.5": ("glm4_moe", dict(config_extra=GLM45)),
    "glm-4.5-air": ("glm4_moe", dict(config_extra=GLM45_AIR)),
    "granite-3-moe": ("granitemoe", dict(tie_word_embeddings=True, config_extra=dict(
        num_local_experts=6, num_experts_per_tok=3, intermediate_size=32, **GRANITE))),
    "granite-3-moe-shared": ("granitemoeshared", dict(config_extra=dict(
        num_local_experts=6, num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=48,
        attention_bias=True, **GRANITE))),
    "phi-3.5-moe-sliding": ("phimoe", dict(config_extra=dict(sliding_window=24, **PHIMOE))),
    "phi-3.5-moe-longrope": ("phimoe", dict(rope_scaling=LONGROPE, config_extra=PHIMOE)),
}


def moe_dir(name: str, build_tiny):
    """The case's folder, its norms' weights drawn around 1 and its biases around 0 (transformers
    builds them 1 and 0), so a LayerNorm's bias or a norm read into the wrong place shows."""
    arch, overrides = MOE[name]
    return with_norms_drawn(build_tiny(f"moe-{name}", arch, num_layers=3, head_dim=16, **overrides), seed=13,
                            mean=1.0)


@pytest.mark.parametrize("name", list(MOE))
def test_a_mixture_of_experts_matches_transformers(name, build_tiny, random_prompts, hf_greedy):
    folder = moe_dir(name, build_tiny)
    longrope = name.endswith("longrope")  # served up to its original context, 64
    prompts = random_prompts(4, 20, 48 if longrope else 90, seed=59)  # past the window, in chunks of 32
    expected = hf_greedy(folder, prompts, 16)
    llm = exact_on_cpu_paths(folder, prompts, expected)
    assert llm.engine.max_model_len == (64 if longrope else 2048)
    assert_top5_logprobs_match(llm, folder, prompts[0])


def test_glm45_reads_its_routing_as_transformers_builds_it(tmp_path, build_tiny):
    """GLM-4.5's folders as released (transformers 4's spelling: rope_theta and partial_rotary_factor
    top level, an MTP layer counted in num_nextn_predict_layers) read as transformers 5's; a folder
    that leaves the routing's fields out reads Glm4MoeConfig's defaults; the half rotation is by
    halves (not GLM-4's adjacent pairs); the correction bias drawn, not transformers' zeros."""
    from safetensors import safe_open
    from transformers import AutoConfig

    folder = moe_dir("glm-4.5", build_tiny)
    cfg = read_model_config(folder)
    assert (cfg.rotary_dim, cfg.rope_interleaved, cfg.qk_norm, cfg.qkv_bias, cfg.o_bias) == (8, False, "head", True,
                                                                                            False)
    assert (cfg.moe.routing, cfg.moe.groups, cfg.moe.scaling, cfg.moe.top_k) == ("grouped_sigmoid", (4, 2), 2.5, 3)
    assert cfg.moe.sparse_layers == (False, True, True) and cfg.moe.shared_intermediate_size == 32
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").abs().min() > 0
    hub = rewritten(folder, tmp_path / "hub", rope_parameters=None, rope_theta=10_000.0, partial_rotary_factor=0.5,
                    dtype=None, torch_dtype="float32", num_nextn_predict_layers=1)
    assert read_model_config(hub) == cfg
    unsaid = rewritten(folder, tmp_path / "unsaid", **dict.fromkeys(
        ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "n_shared_experts", "num_experts_per_tok",
         "first_k_dense_replace", "use_qk_norm", "attention_bias", "moe_intermediate_size")),
                       rope_parameters=dict(rope_type="default", rope_theta=10_000.0))
    for case in (hub, unsaid, moe_dir("glm-4.5-air", build_tiny)):
        ours, theirs = read_model_config(case), AutoConfig.from_pretrained(case)
        moe = ours.moe
        assert (moe.groups, moe.scaling, moe.top_k) == ((theirs.n_group, theirs.topk_group),
                                                        theirs.routed_scaling_factor, theirs.num_experts_per_tok)
        assert moe.norm_topk_prob == theirs.norm_topk_prob and ours.qkv_bias == theirs.attention_bias
        assert moe.shared_intermediate_size == theirs.moe_intermediate_size * theirs.n_shared_experts
        assert moe.sparse_layers == tuple(i >= theirs.first_k_dense_replace for i in range(3))
        assert ours.rotary_dim == 16 * theirs.rope_parameters["partial_rotary_factor"]
        assert (ours.qk_norm == "head") == theirs.use_qk_norm


@pytest.mark.parametrize("arch,changes,message", [
    ("glm4_moe", dict(n_group=3), "n_group 3 and topk_group 2 in config.json: a glm4_moe folder's router needs"),
    ("glm4_moe", dict(n_group=8, topk_group=1), "n_group 8 .*groups of 2 or more"),
    ("glm4_moe", dict(topk_group=1), r"its 3 experts a row within topk_group"),
    ("phimoe", dict(num_experts_per_tok=4), "num_experts_per_tok 4 in config.json: a phimoe folder's sparsemixer"),
    ("phimoe", dict(rope_parameters=dict(rope_type="yarn", rope_theta=10_000.0, factor=2.0, short_mscale=1.0,
                                         long_mscale=1.0)), "rope_type 'yarn' in config.json: a phimoe folder's"),
    ("phimoe", dict(rope_parameters={**LONGROPE, "rope_theta": 10_000.0, "short_mscale": None}),
     "a phimoe folder's longrope RoPE needs short_mscale"),
])
def test_what_a_router_cannot_do_is_refused_by_name(arch, changes, message, tmp_path, build_tiny):
    name = {"glm4_moe": "glm-4.5", "phimoe": "phi-3.5-moe-sliding"}[arch]
    with pytest.raises(ValueError, match=message):
        read_model_config(rewritten(moe_dir(name, build_tiny), tmp_path / "bad", **changes))


def with_mtp_layer(folder, to):
    """The folder copied to `to` with one MTP (next-token prediction) layer past num_hidden_layers, as
    GLM-4.5 and DeepSeek-V3 release theirs (model.layers.92.* of 92: a copy of a decoder layer and
    eh_proj, enorm, hnorm, shared_head), in a shard of its own listed in the index."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, to)
    tensors, last = load_file(to / "model.safetensors"), "model.layers.2."
    extra = {name.replace(last, "model.layers.3."): t.clone() for name, t in tensors.items() if name.startswith(last)}
    extra |= {f"model.layers.3.{name}": torch.randn(*shape) for name, shape in (
        ("eh_proj.weight", (64, 128)), ("enorm.weight", (64,)), ("hnorm.weight", (64,)),
        ("shared_head.norm.weight", (64,)), ("shared_head.head.weight", (2048, 64)))}
    (to / "model.safetensors").unlink()
    save_file(tensors, to / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(extra, to / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = {**dict.fromkeys(tensors, "model-00001-of-00002.safetensors"),
                  **dict.fromkeys(extra, "model-00002-of-00002.safetensors")}
    (to / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return to


def test_glm45_mtp_layers_in_the_checkpoint_are_not_read(tmp_path, build_tiny, random_prompts):
    """The folder loads and serves exactly as it does without them."""
    folder = moe_dir("glm-4.5", build_tiny)
    mtp = with_mtp_layer(folder, tmp_path / "with-mtp")
    assert json.loads((mtp / "config.json").read_text())["num_nextn_predict_layers"] == 1
    prompts = random_prompts(3, 20, 60, seed=61)
    assert tokens(LLM(mtp).generate(prompts, GREEDY)) == tokens(LLM(folder).generate(prompts, GREEDY))


def test_glm45s_router_stays_fp32_in_a_bf16_model(build_tiny, random_prompts):
    """transformers keeps GLM-4.5's router weight and correction bias in fp32 whatever the model's dtype
    (a bf16 bias would move choices by its rounding): so does kvgate."""
    llm = LLM(moe_dir("glm-4.5", build_tiny), dtype="bfloat16")
    layer = llm.engine.runner.model.model.layers[1]
    assert layer.mlp.gate.weight.dtype == layer.mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert layer.mlp.experts[0].down_proj.weight.dtype == torch.bfloat16
    [result] = llm.generate(random_prompts(1, 20, 40, seed=67), GREEDY)
    assert len(result.token_ids) > 0


def test_granite_and_phimoe_configs_read_as_transformers_builds_them(tmp_path, build_tiny):
    """Granite's four scalars and its shared MLP's width; Phi-3.5-MoE's head bias, its sparsemixer
    threshold, LongRoPE capped at the original context with short_mscale on cos and sin; the Hub's
    Phi-3.5-MoE spelling (PhiMoEForCausalLM, rope_scaling "longrope" and rope_theta top level) the same."""
    shared = read_model_config(moe_dir("granite-3-moe-shared", build_tiny))
    assert shared.multipliers == GRANITE and (shared.qkv_bias, shared.o_bias) == (True, True)
    assert (shared.moe.routing, shared.moe.shared_intermediate_size, shared.moe.shared_gate) == ("top_k_softmax", 48,
                                                                                                 False)
    assert read_model_config(moe_dir("granite-3-moe", build_tiny)).moe.shared_intermediate_size is None
    folder = moe_dir("phi-3.5-moe-longrope", build_tiny)
    phi = read_model_config(folder)
    assert (phi.moe.routing, phi.moe.jitter_eps, phi.lm_head_bias, phi.layer_windows) == ("sparsemixer", 0.3, True,
                                                                                          (None,) * 3)
    assert phi.rope_scaling["attention_factor"] == 1.3 and phi.context_cap() == (64, "LongRoPE original context")
    scaling = {k: v for k, v in LONGROPE.items() if k != "rope_type"}
    hub = rewritten(folder, tmp_path / "hub", architectures=["PhiMoEForCausalLM"], rope_parameters=None,
                    rope_theta=10_000.0, rope_scaling={"type": "longrope", **scaling})
    assert read_model_config(hub) == phi
