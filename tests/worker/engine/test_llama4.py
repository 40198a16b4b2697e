"""Llama 4's text model (Llama4ForCausalLM folders, and Llama4ForConditionalGeneration's language_model)
is token-exact with transformers' greedy, on the native and the torch paths, prefilled in chunks and
from the prefix cache, with the top-5 logprobs (1e-5): RoPE by adjacent pairs with Llama 3's scaling,
weightless q/k norms after it in the rotated layers, NoPE layers whose queries are scaled by position
(temperature tuning, here every 4 positions), experts whose inputs (not outputs) are scaled by the
sigmoid of their logit beside a shared expert, stored fused, and dense layers between. Its rotated layers'
chunked attention (a token sees only its own chunk) is served past one chunk: prompts and generations
across several chunks of 16, prefill pieces starting mid-chunk, decodes at a chunk's first and last
positions, on both paths, the top-5 logprobs of every generated token too; the context is not capped."""
import json
import logging

import pytest
import torch

from tests.worker.engine.test_model_families import (GREEDY, assert_top5_logprobs_match, drawn, exact_on_cpu_paths,
                                                     rewritten, saved_beside_tokenizer, text_only_greedy, tokens,
                                                     with_norms_drawn)
from worker.engine.llm import LLM
from worker.engine.types import SamplingParams
from worker.models.config import read_model_config

torch.set_num_threads(1)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10_000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)
# Maverick's layout: experts in every other layer (dense ones between, wider), the fourth layer unrotated,
# q/k norms, Llama 3's RoPE; chunks of 16 (the prompts and their tokens: 36 to 106), the temperature
# stepping every 4
CHUNK = 16
LLAMA4 = {  # name: build_tiny's fields; hidden 64, 4 heads of 16 (2 KV), 4 layers
    "interleaved-experts": dict(intermediate_size=32, config_extra=dict(
        intermediate_size_mlp=96, num_local_experts=4, interleave_moe_layer_step=2, attention_chunk_size=CHUNK,
        floor_scale=4, attn_scale=0.3, rope_parameters=LLAMA3_ROPE)),
    # Scout's: experts in every layer; here two a row, the second layer the unrotated one, no q/k norms,
    # biased attention, a tied head, no chunks
    "every-layer-experts": dict(intermediate_size=32, tie_word_embeddings=True, config_extra=dict(
        num_local_experts=4, num_experts_per_tok=2, no_rope_layers=[1, 0, 1, 1], use_qk_norm=False,
        attention_bias=True, attention_chunk_size=None, floor_scale=4, attn_scale=0.3)),
}


def llama4_dir(name: str, build_tiny):
    """The case's folder, its norms drawn around 1 and its biases around 0 (transformers builds 1 and 0)."""
    return with_norms_drawn(build_tiny(f"llama4-{name}", "llama4", num_layers=4, head_dim=16, **LLAMA4[name]),
                            seed=71, mean=1.0, bias_std=0.1)


@pytest.mark.parametrize("name", list(LLAMA4))
def test_llama4_matches_transformers(name, build_tiny, random_prompts, hf_greedy):
    folder = llama4_dir(name, build_tiny)
    prompts = random_prompts(4, 20, 90, seed=73)
    expected = hf_greedy(folder, prompts, 16)
    llm = exact_on_cpu_paths(folder, prompts, expected)
    assert llm.engine.max_model_len == 2048
    assert_top5_logprobs_match(llm, folder, prompts[1])


def test_llama4_attends_by_chunks_as_transformers_does(tmp_path, build_tiny, random_prompts, hf_greedy):
    """Every generated token's top-5 logprobs (1e-5) on the native and the torch paths, prefilled in
    pieces of 32 and again from the prefix cache, against transformers' forward over the whole text
    (sdpa, as it loads; it masks by chunks there). Its greedy over these prompts differs with causal
    attention in place of the chunks, so exactness here is exactness past one chunk."""
    from transformers import AutoModelForCausalLM

    folder = llama4_dir("interleaved-experts", build_tiny)
    prompts = random_prompts(4, 20, 90, seed=73)
    assert min(map(len, prompts)) > 3 * CHUNK
    unchunked = rewritten(folder, tmp_path / "unchunked", attention_chunk_size=4096)
    assert hf_greedy(unchunked, prompts, 16) != hf_greedy(folder, prompts, 16)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert hf.config._attn_implementation == "sdpa"
    top5 = SamplingParams(max_tokens=CHUNK, temperature=0.0, logprobs=5)  # a chunk's every position decoded
    for backend in ("auto", "torch"):
        llm = LLM(folder, attention_backend=backend, max_num_batched_tokens=32)
        assert (llm.engine.runner.backend.kernels is not None) == (backend == "auto")  # native decode, or torch's
        for cached in (False, True):  # the second time from the prefix cache
            results = llm.generate(prompts, top5)
            assert (llm.engine.stats()["prefix_cache_hits"] > 0) == cached
            for prompt, result in zip(prompts, results):
                text = prompt + result.token_ids
                with torch.no_grad():
                    logits = hf(torch.tensor([text])).logits[0, len(prompt) - 1:-1]
                want = torch.log_softmax(logits, dim=-1).topk(5)
                got = result.outputs[0].logprobs
                assert [[t for t, _ in step.top] for step in got] == want.indices.tolist()
                assert [v for step in got for _, v in step.top] == pytest.approx(want.values.flatten().tolist(),
                                                                                 abs=1e-5)


def test_llama4_reads_as_transformers_builds_it(tmp_path, build_tiny):
    """Each piece where it belongs; a folder that leaves Llama 4's fields out reads Llama4TextConfig's
    defaults (no_rope_layers empty as absent; moe_layers from interleave_moe_layer_step where absent,
    and empty: no sparse layer)."""
    from transformers import AutoConfig

    folder = llama4_dir("interleaved-experts", build_tiny)
    cfg = read_model_config(folder)
    assert (cfg.arch, cfg.rope_layers, cfg.moe.sparse_layers) == ("llama4", (True, True, True, False),
                                                                 (False, True, False, True))
    assert (cfg.intermediate_size, cfg.moe.intermediate_size, cfg.moe.shared_intermediate_size) == (96, 32, 32)
    assert (cfg.moe.routing, cfg.moe.top_k, cfg.qk_norm, cfg.qk_norm_after_rope) == ("sigmoid_inputs", 1,
                                                                                     "weightless", True)
    assert (cfg.rope_interleaved, cfg.rope_scaling["rope_type"], cfg.attn_temperature) == (True, "llama3", (0.3, 4.0))
    assert cfg.context_cap() is None and cfg.layer_windows == (None,) * 4
    assert cfg.layer_chunks == (CHUNK, CHUNK, CHUNK, None)  # the rotated layers; the NoPE one attends everything
    unsaid = rewritten(folder, tmp_path / "unsaid", no_rope_layers=[], **dict.fromkeys((
        "moe_layers", "layer_types", "use_qk_norm", "attn_temperature_tuning", "attn_scale", "floor_scale",
        "rope_parameters", "rms_norm_eps", "num_experts_per_tok", "intermediate_size_mlp", "attention_chunk_size",
        "tie_word_embeddings", "head_dim")))  # interleave_moe_layer_step kept: moe_layers from it
    no_experts = rewritten(folder, tmp_path / "no-experts", moe_layers=[])
    for case in (folder, unsaid, no_experts):
        ours, theirs = read_model_config(case), AutoConfig.from_pretrained(case)
        assert ours.rope_layers == tuple(bool(f) for f in theirs.no_rope_layers)
        assert ours.moe.sparse_layers == tuple(i in theirs.moe_layers for i in range(4))
        assert ours.layer_chunks == tuple(theirs.attention_chunk_size if kind == "chunked_attention" else None
                                          for kind in theirs.layer_types)
        assert (ours.intermediate_size, ours.moe.intermediate_size) == (theirs.intermediate_size_mlp,
                                                                         theirs.intermediate_size)
        assert (ours.head_dim, ours.rms_norm_eps, ours.rope_theta) == (theirs.head_dim, theirs.rms_norm_eps,
                                                                       theirs.rope_parameters["rope_theta"])
        assert (ours.moe.top_k, ours.tie_word_embeddings) == (theirs.num_experts_per_tok, theirs.tie_word_embeddings)
        assert ours.attn_temperature == (theirs.attn_scale, theirs.floor_scale)
        assert (ours.qk_norm == "weightless") == theirs.use_qk_norm
    assert read_model_config(unsaid).moe.sparse_layers == (False, True, False, True)
    assert read_model_config(no_experts).moe.sparse_layers == (False,) * 4


@pytest.mark.parametrize("changes,message", [
    (dict(layer_types=["sliding_attention"] * 4), r"layer_types \['sliding_attention'.*'chunked_attention'"),
    (dict(attention_chunk_size=0), r"layer_types .* \(with an attention_chunk_size\)"),  # as null
    (dict(no_rope_layers=[1, 1, 0]), "no_rope_layers in config.json has 3 entries for 4 layers"),
    (dict(num_experts_per_tok=5), "0 < num_experts_per_tok <= num_local_experts"),
])
def test_what_llama4_cannot_serve_is_refused_by_name(changes, message, tmp_path, build_tiny):
    with pytest.raises(ValueError, match=message):
        read_model_config(rewritten(llama4_dir("interleaved-experts", build_tiny), tmp_path / "bad", **changes))


def test_llama4_is_served_its_whole_context(build_tiny, caplog):
    """Every attention path masks the chunks: no cap at the chunk size, no warning, and an explicit
    --max-model-len past it taken."""
    folder = llama4_dir("interleaved-experts", build_tiny)
    with caplog.at_level(logging.WARNING, logger="kvgate.worker"):
        assert LLM(folder, max_model_len=4 * CHUNK + 1).engine.max_model_len == 4 * CHUNK + 1
    assert "capped" not in caplog.text


def test_a_llama4_multimodal_folder_serves_its_text_model(tmp_path, build_tiny, random_prompts):
    """Llama 4 Scout and Maverick are Llama4ForConditionalGeneration folders: a text_config, the text
    model's weights and head under language_model.*, a vision tower and projector beside (never read).
    The Hub's own spelling of the text_config (attn_temperature_tuning 4, which transformers 5's
    strict config refuses; rope_scaling and rope_theta; no layer_types, no_rope_layers empty) reads the
    same."""
    import transformers

    text_folder = llama4_dir("interleaved-experts", build_tiny)
    text = json.loads((text_folder / "config.json").read_text())
    unsaved = ("architectures", "dtype", "transformers_version", "model_type")
    config = transformers.Llama4Config(
        text_config={k: v for k, v in text.items() if k not in unsaved}, vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
            patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32))
    model = drawn(transformers.Llama4ForConditionalGeneration(config), seed=7)
    folder = saved_beside_tokenizer(model, tmp_path / "llama-4-mm", text_folder)
    cfg = read_model_config(folder)
    assert cfg == read_model_config(text_folder)
    prompts = random_prompts(3, 20, 90, seed=79)
    assert tokens(LLM(folder).generate(prompts, GREEDY)) == text_only_greedy(model, prompts, text["eos_token_id"])
    raw = json.loads((folder / "config.json").read_text())
    hub_text = {k: v for k, v in raw["text_config"].items() if k not in ("rope_parameters", "layer_types")}
    hub_text |= dict(attn_temperature_tuning=4, no_rope_layers=[], rope_theta=10_000.0, torch_dtype="float32",
                     rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"})
    assert read_model_config(rewritten(folder, tmp_path / "hub", text_config=hub_text)) == cfg
