"""Model folders beyond Llama and Qwen: Mistral and Qwen2 with a sliding attention window (masked by
every attention backend), Gemma 1, 2 and 3 (text), Phi-3 (q/k/v and gate/up fused in the checkpoint;
LongRoPE served up to its original context), GLM (RoPE by adjacent pairs), OLMo 1 to 3, Command R
and R7B, ERNIE 4.5, EXAONE 4, Seed-OSS, AFM, StarCoder 2, and YaRN context extension (Qwen2.5's and
Qwen3's long-context configs) are token-exact with
transformers' greedy; what the module cannot compute exactly is refused when the folder is read, by name."""
import json
import logging
import shutil
from dataclasses import replace

import pytest
import torch

from worker.engine.llm import LLM
from worker.engine.types import EngineRejected, SamplingParams
from worker.models.config import read_model_config

torch.set_num_threads(1)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)
HUNYUAN_ALPHA = {"type": "dynamic", "alpha": 1000.0, "factor": 1.0}  # NTK by a fixed alpha: a stretched base
YARN_TUNED = dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=24, beta_fast=16,
                  beta_slow=2, attention_factor=1.3, truncate=False)


def tokens(results) -> list[list[int]]:
    return [r.token_ids for r in results]


def assert_top5_logprobs_match(llm, folder, prompt: list[int]) -> None:
    """The first token's top-5 logprobs are transformers' (1e-5): what greedy alone cannot see (a
    monotonic soft-cap or scaling of the logits, GELU's tanh, the routing's weights)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    [result] = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], dim=-1).topk(5)
    got = result.outputs[0].logprobs[0]
    assert [t for t, _ in got.top] == want.indices.tolist()
    assert [v for _, v in got.top] == pytest.approx(want.values.tolist(), abs=1e-5)


def exact_on_cpu_paths(folder, prompts: list[list[int]], expected: list[list[int]]) -> LLM:
    """Greedy on the native and the torch paths, prefilled in chunks of 32, and again from the
    prefix cache; the torch path's LLM back."""
    for backend in ("auto", "torch"):
        llm = LLM(folder, attention_backend=backend, max_num_batched_tokens=32)
        assert tokens(llm.generate(prompts, GREEDY)) == expected
        assert tokens(llm.generate(prompts, GREEDY)) == expected  # prefix-cache hits
    return llm


def with_norms_drawn(folder, seed: int, mean: float = 0.0, bias_std: float = 0.3):
    """The folder saved again with its norm weights drawn around `mean` (not all 0, nor all 1), so
    Gemma's (1 + w) and the weights of norms transformers builds as ones are tested (Cohere's per-head
    q/k norms, [heads, head_dim], too); its biases (transformers' zeros) around 0, `bias_std` apart
    (small where every linear has one: summed over the layers they would drown out the prompt)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 or "_norm." in name:
                param.normal_(0.0, bias_std) if name.endswith(".bias") else param.normal_(mean, 0.3)
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name,arch,kw", [
    ("mistral", "mistral", dict(config_extra=dict(sliding_window=None))),
    ("phi3", "phi3", {}),
    ("phi4-mini-partial-rotary", "phi3", dict(config_extra=dict(partial_rotary_factor=0.75))),
    ("yarn-qwen2", "qwen2", dict(rope_scaling=YARN, rope_theta=1_000_000.0)),
    ("yarn-tuned-qwen3", "qwen3", dict(rope_scaling=YARN_TUNED, head_dim=32)),
])
def test_matches_transformers(name, arch, kw, build_tiny, random_prompts, hf_greedy):
    model_dir = build_tiny(name, arch, **kw)
    prompts = random_prompts(4, 20, 90, seed=7)  # past YaRN's original context of 24-32 positions
    assert tokens(LLM(model_dir).generate(prompts, GREEDY)) == hf_greedy(model_dir, prompts, 16)


def test_yarn_scales_the_rotary_table():
    """The attention factor reaches cos and sin (without it the YaRN cases above diverge)."""
    from worker.models.llama import rope_inv_freq

    inv, scale = rope_inv_freq(16, 10000.0, YARN)
    plain, one = rope_inv_freq(16, 10000.0, None)
    assert one == 1.0 and scale == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)
    assert inv[0] == plain[0] and inv[-1] == pytest.approx(plain[-1] / 4)  # fast kept, slow interpolated
    assert rope_inv_freq(16, 10000.0, YARN_TUNED)[1] == 1.3


@pytest.mark.parametrize("arch,extra,backend", [
    ("mistral", dict(sliding_window=24), "auto"),  # the native decode kernel
    ("mistral", dict(sliding_window=24), "torch"),
    ("mistral", dict(sliding_window=24), "triton"),  # the Triton kernels, interpreted on CPU
    ("qwen2", dict(use_sliding_window=True, sliding_window=24, max_window_layers=1), "auto"),  # layer 1 slides
])
def test_a_sliding_window_is_attended_as_transformers_does(arch, extra, backend, build_tiny, random_prompts,
                                                           hf_greedy):
    """Prompts past the window, prefilled in chunks of 32 and read again from the prefix cache."""
    model_dir = build_tiny(f"{arch}-window", arch, config_extra=extra)
    assert read_model_config(model_dir).sliding_window == 24
    llm = LLM(model_dir, attention_backend=backend, max_num_batched_tokens=32)
    assert llm.engine.max_model_len == 2048  # not capped: every backend masks the window
    prompts = random_prompts(4, 20, 90, seed=8)
    expected = hf_greedy(model_dir, prompts, 16)
    assert tokens(llm.generate(prompts, GREEDY)) == expected
    hits = llm.engine.stats()["prefix_cache_hits"]
    assert tokens(llm.generate(prompts, GREEDY)) == expected and llm.engine.stats()["prefix_cache_hits"] > hits


GEMMA = dict(head_dim=16, rope_theta=1_000_000.0, tie_word_embeddings=True, config_extra=dict(
    sliding_window=24, sliding_window_pattern=2, query_pre_attn_scalar=16, final_logit_softcapping=30.0))


@pytest.fixture(scope="module")
def gemma_dir(build_tiny):
    """A tiny Gemma 3 whose norm weights are not zero (so (1 + w) is tested), saved again."""
    return with_norms_drawn(build_tiny("gemma3", "gemma3", num_layers=4, **GEMMA), seed=1)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_gemma3_matches_transformers(backend, gemma_dir, random_prompts, hf_greedy):
    """(1 + w) norms, four a layer, scaled embeddings, GELU, query_pre_attn_scalar, soft-capped
    logits, sliding layers (every other one here) with their own RoPE base: past the window, in
    prefill chunks of 32, and again from the prefix cache."""
    cfg = read_model_config(gemma_dir)
    assert (cfg.layer_windows, cfg.local_rope_theta, cfg.rope_theta) == ((24, None, 24, None), 10_000.0, 1_000_000.0)
    llm = LLM(gemma_dir, attention_backend=backend, max_num_batched_tokens=32)
    prompts = random_prompts(4, 20, 90, seed=10)
    expected = hf_greedy(gemma_dir, prompts, 16)
    assert tokens(llm.generate(prompts, GREEDY)) == expected
    assert tokens(llm.generate(prompts, GREEDY)) == expected  # prefix-cache hits
    assert_top5_logprobs_match(llm, gemma_dir, prompts[0])  # the soft-cap and GELU's tanh


GEMMA2 = dict(head_dim=16, tie_word_embeddings=True, config_extra=dict(
    sliding_window=24, query_pre_attn_scalar=16, final_logit_softcapping=30.0, attn_logit_softcapping=0.5))


def test_gemma2_matches_transformers(tmp_path, build_tiny, random_prompts, hf_greedy):
    """Gemma 2: Gemma 3's layer without q/k norms, every other layer sliding, one RoPE, and its
    attention scores soft-capped (a cap of 0.5 here, so that greedy sees it) in every backend —
    the native decode kernel, the torch paths and the (interpreted) Triton kernels; its (1 + w)
    norms with weights not zero; the older config without layer_types reads the same."""
    folder = with_norms_drawn(build_tiny("gemma2", "gemma2", num_layers=4, **GEMMA2), seed=2)
    cfg = read_model_config(folder)
    assert (cfg.arch, cfg.layer_windows, cfg.attn_softcap, cfg.qk_norm) == ("gemma2", (24, None, 24, None), 0.5, None)
    old = rewritten(folder, tmp_path / "old", layer_types=None, rope_parameters=None, rope_theta=10000.0)
    assert read_model_config(old) == cfg
    prompts = random_prompts(4, 20, 90, seed=12)
    expected = hf_greedy(folder, prompts, 16)
    llm = exact_on_cpu_paths(folder, prompts, expected)
    triton = LLM(folder, attention_backend="triton", max_num_batched_tokens=32)
    assert tokens(triton.generate(prompts[:2], GREEDY)) == expected[:2]
    assert_top5_logprobs_match(llm, folder, prompts[0])


def test_gemma3_older_config_reads_the_same(tmp_path, gemma_dir):
    """transformers 4.x wrote rope_theta, rope_local_base_freq and sliding_window_pattern, no
    layer_types; a Gemma 2-style attention soft-cap is refused by name."""
    old = rewritten(gemma_dir, tmp_path / "old", rope_parameters=None, layer_types=None, rope_theta=1_000_000.0,
                    rope_local_base_freq=10_000.0, sliding_window_pattern=2, dtype=None, torch_dtype="float32")
    assert read_model_config(old) == read_model_config(gemma_dir)
    with pytest.raises(ValueError, match="attn_logit_softcapping 50.0"):
        read_model_config(rewritten(gemma_dir, tmp_path / "g2", attn_logit_softcapping=50.0))


def test_gemma1_matches_transformers(tmp_path, build_tiny, random_prompts, hf_greedy):
    """Gemma 1: Llama's two norms a layer, but Gemma's (1 + w) ones (weights not zero here), scaled
    embeddings, GELU-tanh and tied head; no soft-caps, no windows, scores scaled by head_dim^-0.5.
    The first releases' config (hidden_act "gelu", which transformers reads as the tanh GELU; rope_theta
    top level) reads the same; a head_dim left out is GemmaConfig's 256, not hidden / heads."""
    folder = with_norms_drawn(build_tiny("gemma1", "gemma", head_dim=16, tie_word_embeddings=True), seed=4)
    cfg = read_model_config(folder)
    assert (cfg.arch, cfg.layer_windows, cfg.query_pre_attn_scalar, cfg.logit_softcap) == ("gemma", (None,) * 2, None,
                                                                                          None)
    assert cfg.tie_word_embeddings and cfg.qk_norm is None
    old = rewritten(folder, tmp_path / "old", hidden_act="gelu", rope_parameters=None, rope_theta=10000.0,
                    tie_word_embeddings=None)
    assert read_model_config(old) == cfg
    assert read_model_config(rewritten(folder, tmp_path / "unsaid", head_dim=None)).head_dim == 256  # GemmaConfig's
    prompts = random_prompts(4, 20, 90, seed=41)
    expected = hf_greedy(folder, prompts, 16)
    assert_top5_logprobs_match(exact_on_cpu_paths(folder, prompts, expected), folder, prompts[0])


def rewritten(src, dst, **changes):
    """A copy of the folder whose config.json has `changes` (None deletes a field)."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        raw.pop(key, None) if value is None else raw.__setitem__(key, value)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_old_spellings_read_the_same(tmp_path, build_tiny):
    """transformers 4.x wrote YaRN as rope_scaling {"type": "yarn"}, and a Qwen2's window as
    use_sliding_window + max_window_layers, without layer_types."""
    new = build_tiny("yarn-qwen2", "qwen2", rope_scaling=YARN, rope_theta=1_000_000.0)
    old = rewritten(new, tmp_path / "old", rope_parameters=None, rope_theta=1_000_000.0, dtype=None,
                    torch_dtype="float32", rope_scaling={"type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 32})
    assert read_model_config(old) == read_model_config(new)
    windowed = dict(layer_types=None, use_sliding_window=True, sliding_window=40)
    assert read_model_config(rewritten(new, tmp_path / "w1", max_window_layers=1, **windowed)).layer_windows == (None, 40)
    assert read_model_config(rewritten(new, tmp_path / "w2", max_window_layers=2, **windowed)).layer_windows == (None, None)
    llama = rewritten(build_tiny("llama"), tmp_path / "llama", sliding_window=8)  # transformers' Llama ignores it
    assert read_model_config(llama).layer_windows == (None, None)


@pytest.mark.parametrize("changes,message", [
    (dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)),
     "unsupported rope_type 'dynamic'.*default, linear, llama3, yarn, longrope"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.75)),
     "partial_rotary_factor 0.75 .*mistral folder's attention rotates all"),
    (dict(hidden_act="gelu_pytorch_tanh"), "hidden_act 'gelu_pytorch_tanh'"),
    (dict(quantization_config=dict(quant_method="bitsandbytes", load_in_4bit=True)),
     r"quantization_config \(bitsandbytes\)"),
    (dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next"),  # its linear-attention layers
     "unsupported architecture.*Qwen3NextForCausalLM"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping 50.0 in config.json is not supported for a mistral"),
    (dict(architectures=["GlmForCausalLM"], model_type="glm", rope_parameters=dict(  # 5 of 16 values: an odd number
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.3125)),
     "partial_rotary_factor 0.3125 in config.json: supported for Phi-3, GLM and StableLM folders rotating an even"),
    (dict(architectures=["ArceeForCausalLM"], model_type="arcee", hidden_act="silu"),
     "hidden_act 'silu' in config.json: a arcee folder's MLP is 'relu2'"),
    (dict(architectures=["Starcoder2ForCausalLM"], model_type="starcoder2", hidden_act="gelu"),
     "hidden_act 'gelu' in config.json: a starcoder2 folder's MLP is 'gelu_pytorch_tanh'"),
    (dict(architectures=["HunYuanDenseV1ForCausalLM"], model_type="hunyuan_v1_dense", rope_parameters=dict(
        rope_type="dynamic", factor=2.0, rope_theta=10000.0)),  # dynamic NTK: frequencies that follow the length
     "rope_type 'dynamic' without an alpha in config.json: a hunyuan_v1_dense folder's dynamic NTK RoPE"),
    (dict(architectures=["ApertusForCausalLM"], model_type="apertus", hidden_act="relu2"),
     "hidden_act 'relu2' in config.json: a apertus folder's MLP is 'xielu'"),
])
def test_what_the_module_cannot_compute_is_refused_by_name(tmp_path, build_tiny, changes, message):
    folder = rewritten(build_tiny("mistral", "mistral", config_extra=dict(sliding_window=None)),
                       tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        read_model_config(folder)


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_phi3_long_rope_is_served_exactly_within_its_original_context(partial, tmp_path, build_tiny, random_prompts,
                                                                      hf_greedy, caplog):
    """Phi-3.5-mini's shape of config (LongRoPE, "su" in older folders), and Phi-4-mini's (LongRoPE
    over 3/4 of each head): capped at the original context, where transformers uses the short
    factors and the attention factor."""
    pairs = int(16 * partial) // 2  # head_dim 16
    factors = dict(short_factor=[1.0 + 0.25 * i for i in range(pairs)], long_factor=[4.0 + i for i in range(pairs)])
    model_dir = build_tiny(f"phi3-longrope-{partial}", "phi3", rope_scaling=dict(rope_type="longrope", **factors),
                           config_extra=dict(original_max_position_embeddings=64, partial_rotary_factor=partial))
    assert read_model_config(model_dir).rope_scaling["factor"] == 2048 / 64
    with caplog.at_level(logging.WARNING, logger="kvgate.worker"):
        llm = LLM(model_dir)
    assert llm.engine.max_model_len == 64 and "LongRoPE original context, 64 tokens" in caplog.text
    prompts = random_prompts(4, 20, 48, seed=9)
    expected = hf_greedy(model_dir, prompts, 16)
    assert tokens(llm.generate(prompts, GREEDY)) == expected  # the native kernels' rope
    assert tokens(LLM(model_dir, attention_backend="torch").generate(prompts, GREEDY)) == expected  # torch's
    old = rewritten(model_dir, tmp_path / "su", rope_parameters=None, rope_theta=10000.0,
                    rope_scaling=dict(type="su", **factors))
    assert read_model_config(old) == read_model_config(model_dir)
    short = rewritten(model_dir, tmp_path / "short", rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=partial, short_factor=[1.0] * (pairs - 1),
        long_factor=[1.0] * pairs))
    with pytest.raises(ValueError, match=f"short_factor in config.json must have rotary dims / 2 = {pairs} numbers"):
        read_model_config(short)


def drawn(model, seed: int, norms_around: float = 1.0):
    """The model's weights drawn at random (its vision tower's too), norms around `norms_around`."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(norms_around, 0.3) if param.dim() == 1 else param.normal_(0.0, 0.08)
    return model.eval()


def saved_beside_tokenizer(model, folder, text_folder):
    """A multimodal model saved as a folder, with a text folder's tokenizer."""
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(text_folder / name, folder / name)
    return folder


@torch.no_grad()
def text_only_greedy(model, prompts: list[list[int]], eos: int) -> list[list[int]]:
    """The multimodal model's own generate, on text alone."""
    return [model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=0,
                           eos_token_id=eos)[0, len(p):].tolist() for p in prompts]


def test_a_multimodal_gemma3_folder_serves_its_text_model(tmp_path, gemma_dir, random_prompts):
    """Gemma 3 4B and up are Gemma3ForConditionalGeneration folders: a text_config, the text model's
    weights under language_model.model.*, a vision tower beside. kvgate serves the text model."""
    import transformers

    text = json.loads((gemma_dir / "config.json").read_text())
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "sliding_window", "layer_types", "query_pre_attn_scalar",
            "final_logit_softcapping", "rope_parameters", "max_position_embeddings")
    config = transformers.Gemma3Config(
        text_config={k: text[k] for k in keep}, mm_tokens_per_image=4,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14))
    model = drawn(transformers.Gemma3ForConditionalGeneration(config), seed=2, norms_around=0.0)
    folder = saved_beside_tokenizer(model, tmp_path / "gemma-3-mm", gemma_dir)
    assert "text_config" in json.loads((folder / "config.json").read_text())
    cfg = read_model_config(folder)
    assert (cfg.arch, cfg.num_layers, cfg.layer_windows, cfg.tie_word_embeddings) == ("gemma3", 4, (24, None) * 2, True)
    prompts = random_prompts(3, 20, 60, seed=11)
    assert tokens(LLM(folder).generate(prompts, GREEDY)) == text_only_greedy(model, prompts, text["eos_token_id"])


@pytest.mark.parametrize("text_model", ["mistral", "ministral3"])
def test_a_mistral3_folder_serves_its_text_model(text_model, tmp_path, build_tiny, random_prompts):
    """Mistral Small 3.1 and 3.2 (a Mistral text model) and Ministral 3 (a Ministral 3 one) are
    Mistral3ForConditionalGeneration folders: a text_config (transformers' defaults filled in), the
    text model's weights and head under language_model.*, a vision tower and projector beside. The
    folder's top level says nothing of tying, as the Hub's do: the head is the checkpoint's own
    (the text config's tie_word_embeddings, false)."""
    import transformers

    text_folder = (build_tiny("mistral-window", "mistral", config_extra=dict(sliding_window=24))
                   if text_model == "mistral" else
                   build_tiny("ministral3", "ministral3", config_extra=dict(rope_parameters=MINISTRAL3_ROPE)))
    text = json.loads((text_folder / "config.json").read_text())
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "sliding_window", "rope_parameters", "max_position_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id")
    config = transformers.Mistral3Config(
        text_config={"model_type": text_model, **{k: text[k] for k in keep if k in text}},
        tie_word_embeddings=False, spatial_merge_size=1,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           head_dim=16, image_size=28, patch_size=14))
    model = drawn(transformers.Mistral3ForConditionalGeneration(config), seed=4)
    folder = saved_beside_tokenizer(model, tmp_path / "mistral-3-mm", text_folder)
    raw = json.loads((folder / "config.json").read_text())
    del raw["tie_word_embeddings"]
    (folder / "config.json").write_text(json.dumps(raw))
    cfg = read_model_config(folder)
    windows = (24, 24) if text_model == "mistral" else (None, None)
    assert (cfg.arch, cfg.layer_windows, cfg.tie_word_embeddings) == (text_model, windows, False)
    assert cfg.query_scaling == (None if text_model == "mistral" else (0.1, 32))  # past 32: prompts up to 60
    prompts = random_prompts(3, 20, 60, seed=23)
    assert tokens(LLM(folder).generate(prompts, GREEDY)) == text_only_greedy(model, prompts, text["eos_token_id"])
    other = rewritten(folder, tmp_path / "llama4-text", text_config={**raw["text_config"],
                                                                       "model_type": "llama4_text"})
    with pytest.raises(ValueError, match="with a 'llama4_text' text model is not supported"):
        read_model_config(other)

@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_qwen_vl_folder_serves_its_text_model(family, tmp_path, build_tiny, random_prompts):
    """Qwen2.5-VL (a Qwen2 text model; the Hub's folders keep its fields at the top level, RoPE
    "mrope") and Qwen3-VL (a Qwen3 one; interleaved multimodal RoPE, deepstack): on text alone the
    three position axes are equal and the multimodal RoPE rotates as plain RoPE does, so the text
    model is served as Qwen2's or Qwen3's, token-exact with the multimodal model's generate."""
    import transformers

    arch = {"qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}[family]
    text_folder = build_tiny(f"{arch}-head16", arch, head_dim=16)
    text = json.loads((text_folder / "config.json").read_text())
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "bos_token_id", "eos_token_id",
            "pad_token_id")
    text_config = {k: text[k] for k in keep}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                  spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen2_5_vl":
        config = transformers.Qwen2_5_VLConfig(
            text_config={**text_config, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3],
                                                         "rope_theta": 10_000.0}},
            vision_config={**vision, "patch_size": 14, "window_size": 56, "fullatt_block_indexes": [0]})
        model = drawn(transformers.Qwen2_5_VLForConditionalGeneration(config), seed=5)
    else:
        config = transformers.Qwen3VLConfig(
            text_config={**text_config, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                                            "mrope_interleaved": True, "rope_theta": 10_000.0}},
            vision_config={**vision, "patch_size": 16, "deepstack_visual_indexes": [0], "num_position_embeddings": 16})
        model = drawn(transformers.Qwen3VLForConditionalGeneration(config), seed=6)
    folder = saved_beside_tokenizer(model, tmp_path / family, text_folder)
    cfg = read_model_config(folder)
    assert (cfg.arch, cfg.rope_scaling, cfg.qk_norm) == (arch, None, "head" if arch == "qwen3" else None)
    prompts = random_prompts(3, 20, 60, seed=31)
    assert tokens(LLM(folder).generate(prompts, GREEDY)) == text_only_greedy(model, prompts, text["eos_token_id"])
    if family == "qwen2_5_vl":  # the Hub's layout: the text model's fields at the top, no text_config
        raw = json.loads((folder / "config.json").read_text())
        flat = {**{k: v for k, v in raw.items() if k != "text_config"}, **raw["text_config"],
                "model_type": "qwen2_5_vl", "rope_theta": 10_000.0,
                "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
        del flat["rope_parameters"]
        hub = tmp_path / "hub-layout"
        shutil.copytree(folder, hub)
        (hub / "config.json").write_text(json.dumps(flat))
        assert read_model_config(hub) == cfg

MOE = {  # name: (arch, config fields); hidden 64, 2 layers (conftest's TINY)
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "mixtral-window": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=24)),
    "qwen2-moe-shared-expert": ("qwen2_moe", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=48)),
    "qwen3-moe-a-dense-layer": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                                  norm_topk_prob=True, mlp_only_layers=[1])),
}


@pytest.mark.parametrize("name", list(MOE))
def test_a_mixture_of_experts_matches_transformers(name, build_tiny, random_prompts, hf_greedy):
    """Mixtral (renormalised fp32 weights, its block_sparse_moe names), Qwen2-MoE (a sigmoid-gated
    shared expert, weights not renormalised) and Qwen3-MoE (renormalised; a dense layer among the
    sparse): greedy on the native and the torch paths, prefilled in chunks and from the prefix cache;
    the routing's weights (which greedy alone barely sees) through the top-5 logprobs."""
    arch, extra = MOE[name]
    model_dir = build_tiny(f"moe-{name}", arch, config_extra=extra)
    prompts = random_prompts(4, 20, 90, seed=11)
    expected = hf_greedy(model_dir, prompts, 16)
    llm = exact_on_cpu_paths(model_dir, prompts, expected)
    if name == "mixtral-window":  # the Triton kernels (interpreted), which would capture decode in CUDA graphs
        triton = LLM(model_dir, attention_backend="triton", pad_decode_eagerly=True)
        assert triton.engine.runner.decode_graphs is None  # routing reads row counts on the host
        assert tokens(triton.generate(prompts[:2], GREEDY)) == expected[:2]
    assert_top5_logprobs_match(llm, model_dir, prompts[0])


def test_a_mixture_of_experts_config_reads_as_transformers_builds_it(tmp_path, build_tiny):
    """Which layers are sparse (decoder_sparse_step, mlp_only_layers), each expert's width, the
    routing's options; Mixtral's sliding window in every layer; a top k above the experts refused."""
    qwen = build_tiny("moe-qwen3-moe-a-dense-layer", "qwen3_moe", config_extra=MOE["qwen3-moe-a-dense-layer"][1])
    moe = read_model_config(qwen).moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (8, 3, 32)
    assert moe.norm_topk_prob and not moe.weights_fp32
    assert moe.sparse_layers == (True, False) and moe.shared_intermediate_size is None
    stepped = rewritten(qwen, tmp_path / "step", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert read_model_config(stepped).moe.sparse_layers == (False, True, False, False)
    mixtral = read_model_config(build_tiny("moe-mixtral-window", "mixtral", config_extra=MOE["mixtral-window"][1]))
    assert mixtral.layer_windows == (24, 24) and mixtral.moe.weights_fp32 and mixtral.moe.intermediate_size == 128
    assert read_model_config(qwen).layer_windows == (None, None)
    hub = rewritten(qwen, tmp_path / "hub", num_local_experts=None, num_experts=8)  # the Hub's spelling
    assert read_model_config(hub) == read_model_config(qwen)
    with pytest.raises(ValueError, match=r"0 < num_experts_per_tok <= it \(here 9\)"):
        read_model_config(rewritten(qwen, tmp_path / "topk", num_experts_per_tok=9))


def test_granite_matches_transformers(build_tiny, random_prompts, hf_greedy):
    """Granite 3: Llama's layers with embeddings, residual branches, scores and logits scaled (a
    Granite-3.1-2B's four values), on the native and torch paths; the logits' scaling, invisible
    to greedy, through the top-5 logprobs."""
    scalars = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                   logits_scaling=8.0)
    folder = build_tiny("granite", "granite", config_extra=scalars)
    assert read_model_config(folder).multipliers == scalars
    prompts = random_prompts(4, 20, 90, seed=13)
    expected = hf_greedy(folder, prompts, 16)
    assert_top5_logprobs_match(exact_on_cpu_paths(folder, prompts, expected), folder, prompts[0])


OLMO = {  # name: (arch, config fields); hidden 64, 4 layers
    "olmo2": ("olmo2", {}),
    "olmo3-yarn-on-full-layers": ("olmo3", dict(sliding_window=24, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32))),
    "olmoe-clipped": ("olmoe", dict(num_experts=4, num_experts_per_tok=2, clip_qkv=0.3)),
}

SMOLLM3 = dict(use_sliding_window=True, sliding_window=24)


@pytest.mark.parametrize("name", list(OLMO))
def test_olmo_matches_transformers(name, build_tiny, random_prompts, hf_greedy):
    """OLMo 2 (norms after each branch, none before; q and k normed across all their heads), OLMo 3
    (three sliding layers to one full, YaRN on the full ones only) and OLMoE (Llama's layer order
    with OLMo's q/k norms, q/k/v clipped, eight experts of which two): greedy on the native and
    torch paths, chunked and from the prefix cache, and the top-5 logprobs; norm weights drawn
    around 1, so a norm's weight read into the wrong place shows."""
    arch, extra = OLMO[name]
    folder = with_norms_drawn(build_tiny(name, arch, num_layers=4, config_extra=extra), seed=3, mean=1.0)
    cfg = read_model_config(folder)
    assert cfg.qk_norm == "whole" and cfg.post_norm == (arch != "olmoe")
    prompts = random_prompts(4, 20, 90, seed=17)  # past the window and YaRN's original context
    expected = hf_greedy(folder, prompts, 16)
    assert_top5_logprobs_match(exact_on_cpu_paths(folder, prompts, expected), folder, prompts[0])


def test_olmo1_matches_transformers(build_tiny, random_prompts, hf_greedy):
    """OLMo 1: Llama's layer with LayerNorms that have no weight (epsilon 1e-5, whatever rms_norm_eps
    says), q/k/v and o biases (drawn, not zero) and q, k, v clipped before RoPE; a tied head."""
    extra = dict(clip_qkv=0.3, attention_bias=True, rms_norm_eps=0.5)
    folder = with_norms_drawn(build_tiny("olmo1", "olmo", tie_word_embeddings=True, config_extra=extra), seed=5)
    cfg = read_model_config(folder)
    assert (cfg.arch, cfg.clip_qkv, cfg.qkv_bias, cfg.o_bias, cfg.qk_norm) == ("olmo", 0.3, True, True, None)
    prompts = random_prompts(4, 20, 90, seed=43)
    expected = hf_greedy(folder, prompts, 16)
    assert_top5_logprobs_match(exact_on_cpu_paths(folder, prompts, expected), folder, prompts[0])


@pytest.mark.parametrize("arch", ["glm", "glm4"])
def test_glm_matches_transformers(arch, tmp_path, build_tiny, random_prompts, hf_greedy):
    """GLM-4 (glm-4-9b-chat-hf) and GLM-4-0414: RoPE on half of each head, turning adjacent pairs,
    not halves; q/k/v biased (drawn, not zero), o not; gate/up one tensor in the checkpoint; GLM-4-0414's
    branch outputs normed (weights drawn around 1) before their residual adds. The transformers 4
    spelling (partial_rotary_factor and rope_theta top level, or no factor: half) reads the same."""
    folder = with_norms_drawn(build_tiny(arch, arch, head_dim=32), seed=6, mean=1.0)
    cfg = read_model_config(folder)
    assert (cfg.rotary_dim, cfg.rope_interleaved, cfg.qkv_bias, cfg.o_bias) == (16, True, True, False)
    assert cfg.branch_norms == (arch == "glm4") and cfg.layer_windows == (None, None)
    for name, top in (("old", dict(partial_rotary_factor=0.5)), ("unsaid", {})):
        old = rewritten(folder, tmp_path / name, rope_parameters=None, rope_theta=10000.0, attention_bias=None, **top)
        assert read_model_config(old) == cfg
    prompts = random_prompts(4, 20, 90, seed=47)
    expected = hf_greedy(folder, prompts, 16)
    assert_top5_logprobs_match(exact_on_cpu_paths(folder, prompts, expected), folder, prompts[0])


COHERE = {  # name: (arch, config fields); hidden 64, 4 heads of 16, 4 layers
    "command-r-plus-qk-norms": ("cohere", dict(use_qk_norm=True, attention_bias=True, logit_scale=0.25)),
    "command-r7b-sliding": ("cohere2", dict(sliding_window=24)),
}


@pytest.mark.parametrize("name", list(COHERE))
def test_cohere_matches_transformers(name, tmp_path, build_tiny, random_prompts, hf_greedy):
    """Command R: one LayerNorm feeding the attention and the MLP side by side, RoPE by adjacent pairs,
    logits scaled, the head tied; here with Command R+'s per-head q/k LayerNorms (each head its own
    weights, drawn around 1) and biases; and Command R7B: three sliding layers to one full, only the
    sliding ones rotated, past the window. Greedy on both CPU paths, chunked and from the prefix cache,
    and the top-5 logprobs (the logit scale). R7B's Hub config (sliding_window_pattern, no
    layer_types) reads the same."""
    arch, extra = COHERE[name]
    folder = build_tiny(name, arch, num_layers=4, tie_word_embeddings=True, config_extra=extra)
    folder = with_norms_drawn(folder, seed=7, mean=1.0)
    cfg = read_model_config(folder)
    assert cfg.rope_interleaved and cfg.rotary_dim == 16 and cfg.tie_word_embeddings
    if arch == "cohere":
        assert (cfg.qk_norm, cfg.qkv_bias, cfg.o_bias, cfg.logit_scale, cfg.rope_layers) == ("head", True, True, 0.25,
                                                                                             None)
    else:
        assert (cfg.layer_windows, cfg.rope_layers) == ((24, 24, 24, None), (True, True, True, False))
        hub = rewritten(folder, tmp_path / "hub", layer_types=None, rope_parameters=None, rope_theta=10000.0,
                        sliding_window_pattern=4)
        assert read_model_config(hub) == cfg
    prompts = random_prompts(4, 20, 90, seed=53)
    expected = hf_greedy(folder, prompts, 16)
    assert_top5_logprobs_match(exact_on_cpu_paths(folder, prompts, expected), folder, prompts[0])


DENSE = {  # name: (arch, build_tiny's fields, what the config reads as); hidden 64, 4 heads of 16, 4 layers
    "ernie4_5-biased": ("ernie4_5", dict(head_dim=16, config_extra=dict(use_bias=True)),
                        dict(rope_interleaved=True, rotary_dim=16, qkv_bias=True, o_bias=True, mlp_bias=True,
                             layer_windows=(None,) * 4)),
    "exaone4-hybrid": ("exaone4", dict(config_extra=dict(sliding_window=24, sliding_window_pattern=4)),
                       dict(post_norm=True, qk_norm="head", layer_windows=(24, 24, 24, None),
                            rope_layers=(True, True, True, False))),
    "seed-oss-o-biased-alone": ("seed_oss", dict(head_dim=16, config_extra=dict(
        attention_bias=False, attention_out_bias=True, mlp_bias=True)),
                                dict(qkv_bias=False, o_bias=True, mlp_bias=True)),
    "arcee-relu2-yarn": ("arcee", dict(rope_scaling=YARN, config_extra=dict(attention_bias=True, mlp_bias=True)),
                         dict(qkv_bias=True, o_bias=True, mlp_bias=True, layer_windows=(None,) * 4)),
    "starcoder2-window": ("starcoder2", dict(config_extra=dict(sliding_window=24, norm_epsilon=0.001)),
                          dict(qkv_bias=True, o_bias=True, mlp_bias=True, layer_windows=(24,) * 4,
                               rms_norm_eps=0.001)),
    "stablelm2-zephyr": ("stablelm", dict(config_extra=dict(use_qkv_bias=True)),  # a quarter of each head rotated
                         dict(rotary_dim=4, qkv_bias=True, o_bias=False, qk_norm=None, parallel_residual=False)),
    "stablelm2-12b-parallel": ("stablelm", dict(config_extra=dict(
        qk_layernorm=True, use_parallel_residual=True, partial_rotary_factor=0.5, layer_norm_eps=0.001)),
                               dict(rotary_dim=8, qkv_bias=False, qk_norm="head", parallel_residual=True,
                                    rms_norm_eps=0.001)),
    "hunyuan-ntk-alpha-biased": ("hunyuan_v1_dense", dict(head_dim=16, rope_scaling=HUNYUAN_ALPHA, config_extra=dict(
        attention_bias=True, mlp_bias=True)),  # mlp_bias: its class never biases the MLP
                                 dict(qk_norm="head", qk_norm_after_rope=True, qkv_bias=True, o_bias=True,
                                      mlp_bias=False, rope_scaling=None, rope_theta=10000.0 * 1000.0 ** (16 / 14))),
    "apertus-xielu": ("apertus", dict(config_extra=dict(attention_bias=True, mlp_bias=True)),  # Llama 3's RoPE
                      dict(qk_norm="head", qkv_bias=True, o_bias=True, mlp_bias=False, rope_theta=12_000_000.0)),
}


@pytest.mark.parametrize("name", list(DENSE))
def test_a_dense_family_matches_transformers(name, build_tiny, random_prompts, hf_greedy):
    """ERNIE 4.5 (RoPE by adjacent pairs over the whole head, every linear biased by use_bias); EXAONE 4
    (OLMo 2's norms after each branch, none before, q/k normed per head, three sliding layers to one
    full, only the sliding ones rotated); Seed-OSS (o's bias by attention_out_bias, apart from q/k/v's);
    AFM (a non-gated MLP: up, ReLU², down; YaRN); StarCoder 2 (biased LayerNorms, a non-gated GELU-tanh
    MLP, every linear biased, a window in every layer); StableLM 2 (biased LayerNorms, part of each head
    rotated, q/k/v biased; the 12B's q/k LayerNormed per head, each head's own weights, and the attention
    and MLP side by side); Hunyuan (q/k normed per head after RoPE; NTK by a fixed alpha, q/k/v and o
    biased); Apertus (a non-gated xIELU MLP, its two learned scalars drawn, q/k normed per head, Llama 3's
    RoPE on a base of 12M where it says nothing): greedy on both CPU paths, past the windows,
    chunked and from the prefix cache, and the top-5 logprobs; norm weights drawn around 1 and biases
    around 0 (narrowly: summed over the layers, wide ones drown out the prompt), so that each is read
    where it belongs."""
    arch, build, reads = DENSE[name]
    folder = with_norms_drawn(build_tiny(name, arch, num_layers=4, **build), seed=59, mean=1.0, bias_std=0.05)
    cfg = read_model_config(folder)
    assert {field: getattr(cfg, field) for field in reads} == reads
    prompts = random_prompts(4, 20, 90, seed=61)
    expected = hf_greedy(folder, prompts, 16)
    assert_top5_logprobs_match(exact_on_cpu_paths(folder, prompts, expected), folder, prompts[0])


UNSAID = ("head_dim", "rope_parameters", "tie_word_embeddings", "use_bias", "attention_bias", "attention_out_bias",
          "mlp_bias", "sliding_window", "sliding_window_pattern", "layer_types", "norm_epsilon", "rms_norm_eps",
          "use_qkv_bias", "qk_layernorm", "use_parallel_residual", "layer_norm_eps", "partial_rotary_factor")


@pytest.mark.parametrize("name", list(DENSE))
def test_a_dense_familys_unsaid_fields_read_as_transformers_fills_them_in(name, tmp_path, build_tiny):
    """A Hub config leaving out what its class defaults (head_dim, RoPE base, tying, biases, epsilon,
    EXAONE 4's window and its pattern, StableLM's rotated share, q/k norms and residuals) reads as
    transformers builds the model: its config's values and which of its linears have biases."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch, build, _ = DENSE[name]
    unsaid = [f for f in UNSAID if not (arch == "hunyuan_v1_dense" and f == "head_dim")]  # its class needs one
    folder = rewritten(build_tiny(name, arch, num_layers=4, **build), tmp_path / "unsaid", **dict.fromkeys(unsaid))
    cfg, theirs = read_model_config(folder), AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        layer = AutoModelForCausalLM.from_config(theirs).model.layers[0]
    mlp_down = getattr(layer.mlp, "down_proj", None) or layer.mlp.c_proj
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == tuple(
        m.bias is not None for m in (layer.self_attn.q_proj, layer.self_attn.o_proj, mlp_down))
    assert (cfg.head_dim, cfg.rope_theta, cfg.tie_word_embeddings) == (
        layer.self_attn.head_dim, theirs.rope_parameters["rope_theta"], theirs.tie_word_embeddings)
    assert cfg.rms_norm_eps == next(getattr(theirs, name) for name in ("norm_epsilon", "layer_norm_eps", "rms_norm_eps")
                                    if hasattr(theirs, name))
    assert cfg.rotary_dim == int(cfg.head_dim * theirs.rope_parameters.get("partial_rotary_factor", 1.0))
    if arch == "stablelm":  # StableLmConfig's quarter of each head, no q/k norms, Llama's residuals
        assert (cfg.rotary_dim, cfg.qk_norm, cfg.parallel_residual) == (4, None, False)
        assert (layer.self_attn.qk_layernorm, layer.use_parallel_residual) == (False, False)
    if arch == "exaone4":
        windows = tuple(theirs.sliding_window if kind == "sliding_attention" else None for kind in theirs.layer_types)
        assert cfg.layer_windows == windows == (4096, 4096, 4096, None)
        assert cfg.rope_layers == (True, True, True, False)
        one_kind = rewritten(folder, tmp_path / "global")  # a null window: every layer full, and rotated
        raw = json.loads((one_kind / "config.json").read_text())
        (one_kind / "config.json").write_text(json.dumps({**raw, "sliding_window": None}))
        global_cfg = read_model_config(one_kind)
        assert (global_cfg.layer_windows, global_cfg.rope_layers) == ((None,) * 4, None)


def test_smollm3_matches_transformers(build_tiny, random_prompts, hf_greedy):
    """SmolLM3: every fourth layer without RoPE (NoPE), here also the one sliding layer
    (use_sliding_window puts windows on the NoPE layers by default)."""
    folder = build_tiny("smollm3", "smollm3", num_layers=4, config_extra=SMOLLM3)
    cfg = read_model_config(folder)
    assert (cfg.rope_layers, cfg.layer_windows) == ((True, True, True, False), (None, None, None, 24))
    prompts = random_prompts(4, 20, 90, seed=19)
    exact_on_cpu_paths(folder, prompts, hf_greedy(folder, prompts, 16))


MINISTRAL3_ROPE = dict(rope_type="yarn", rope_theta=1_000_000.0, factor=16.0, original_max_position_embeddings=32,
                       beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1)


def test_ministral3_matches_transformers(tmp_path, build_tiny, random_prompts, hf_greedy):
    """Ministral 3: Mistral's layers, YaRN, and queries scaled by 1 + 0.1 ln(1 + floor(p / 32)) —
    prompts up to 90 tokens, so three steps of it — on both CPU paths and in the top-5 logprobs;
    its RoPE parameters without the scaling's two numbers refused by name."""
    folder = build_tiny("ministral3", "ministral3", config_extra=dict(rope_parameters=MINISTRAL3_ROPE))
    assert read_model_config(folder).query_scaling == (0.1, 32)
    prompts = random_prompts(4, 20, 90, seed=29)
    expected = hf_greedy(folder, prompts, 16)
    assert_top5_logprobs_match(exact_on_cpu_paths(folder, prompts, expected), folder, prompts[2])
    plain = {k: v for k, v in MINISTRAL3_ROPE.items() if k != "llama_4_scaling_beta"}
    with pytest.raises(ValueError, match="need llama_4_scaling_beta and original_max_position_embeddings"):
        read_model_config(rewritten(folder, tmp_path / "no-beta", rope_parameters=plain))


def test_olmo_and_smollm3_configs_read_as_transformers_builds_them(tmp_path, build_tiny):
    """OLMo 3's older spelling (rope_scaling and rope_theta for the full layers, no layer_types)
    reads as transformers 5's; SmolLM3's NoPE layers from no_rope_layer_interval when the list is
    absent, and refused when it does not cover the layers; its window only with use_sliding_window."""
    arch, extra = OLMO["olmo3-yarn-on-full-layers"]
    olmo3 = build_tiny("olmo3-theta-500k", arch, num_layers=4, rope_theta=500_000.0, config_extra=extra)
    new = read_model_config(olmo3)
    assert new.layer_windows == (24, 24, 24, None) and new.rope_scaling["rope_type"] == "yarn"
    assert new.local_rope_theta == new.rope_theta == 500_000.0
    greedy_case = read_model_config(build_tiny("olmo3-yarn-on-full-layers", arch, num_layers=4, config_extra=extra))
    # a rope_theta given to Olmo3Config reaches the full layers only (as transformers 5 sets them)
    assert (greedy_case.rope_theta, greedy_case.local_rope_theta) == (10_000.0, 500_000.0)
    old = rewritten(olmo3, tmp_path / "olmo3-old", rope_parameters=None, layer_types=None, rope_theta=500_000.0,
                    rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32))
    assert read_model_config(old) == new
    smol = build_tiny("smollm3", "smollm3", num_layers=4, config_extra=SMOLLM3)
    eight = rewritten(smol, tmp_path / "smol8", num_hidden_layers=8, no_rope_layers=None, layer_types=None)
    assert read_model_config(eight).rope_layers == (True, True, True, False) * 2
    assert read_model_config(eight).layer_windows == (None, None, None, 24) * 2
    unwindowed = rewritten(smol, tmp_path / "smol-full", use_sliding_window=False)
    assert read_model_config(unwindowed).layer_windows == (None,) * 4
    with pytest.raises(ValueError, match="no_rope_layers in config.json has 3 entries for 4 layers"):
        read_model_config(rewritten(smol, tmp_path / "smol3", no_rope_layers=[1, 1, 0]))


GPT_OSS_YARN = dict(rope_type="yarn", rope_theta=10_000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                    original_max_position_embeddings=32, truncate=False)
GPT_OSS = dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=24, head_dim=16, swiglu_alpha=1.5,
               swiglu_limit=0.5, rope_parameters=GPT_OSS_YARN)


@pytest.fixture(scope="module")
def gpt_oss_dir(build_tiny):
    """Four layers (sliding, full, sliding, full), a limit low enough that the SwiGLU's clamps bite;
    the norms' weights drawn around 1, the sinks around 0 (as large as the scores), the biases small."""
    from transformers import AutoModelForCausalLM

    folder = build_tiny("gpt-oss", "gpt_oss", num_layers=4, config_extra=GPT_OSS)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.normal_(*(1.0, 0.3) if "norm" in name else (0.0, 1.0) if "sinks" in name else (0.0, 0.1))
    model.save_pretrained(folder)
    return folder


def test_gpt_oss_matches_transformers(gpt_oss_dir, random_prompts, hf_greedy):
    """gpt-oss: sinks in every attention, windows on every other layer, YaRN, q/k/v/o biases, a router
    with a bias, experts' interleaved gate/up with biases and a clamped SwiGLU: greedy on the native
    and torch paths, chunked and from the prefix cache, and the top-5 logprobs (the routing's weights)."""
    cfg = read_model_config(gpt_oss_dir)
    assert cfg.attn_sinks and cfg.swiglu == (1.5, 0.5) and cfg.layer_windows == (24, None, 24, None)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.qkv_bias, cfg.o_bias) == (4, 2, True, True)
    prompts = random_prompts(4, 20, 90, seed=31)  # past the window and YaRN's original context
    expected = hf_greedy(gpt_oss_dir, prompts, 16)
    assert_top5_logprobs_match(exact_on_cpu_paths(gpt_oss_dir, prompts, expected), gpt_oss_dir, prompts[1])


def test_a_gpt_oss_hub_config_reads_as_transformers_5s(tmp_path, gpt_oss_dir):
    """The released folders' spelling (rope_scaling and rope_theta, no layer_types, no swiglu_alpha)
    reads as transformers 5's: YaRN without truncation, sliding layers first, alpha 1.702."""
    new = read_model_config(gpt_oss_dir)
    yarn = {k: v for k, v in GPT_OSS["rope_parameters"].items() if k != "rope_theta"}
    old = read_model_config(rewritten(gpt_oss_dir, tmp_path / "hub", rope_parameters=None, rope_scaling=yarn,
                                      rope_theta=10_000.0, layer_types=None, swiglu_alpha=None))
    assert old.swiglu == (1.702, 0.5) and old.rope_scaling["truncate"] is False
    assert old == replace(new, swiglu=(1.702, 0.5))


def test_a_gpt_oss_mxfp4_folder_serves_its_experts_dequantized(tmp_path, gpt_oss_dir, random_prompts, hf_greedy):
    """The released folders' MXFP4 experts (blocks of FP4 codes, a power-of-two scale per 32) are
    dequantized as they load — bit for bit as transformers' own conversion does — and the model is
    token-exact with transformers on the dequantized weights; MXFP4 elsewhere stays refused."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from worker.models.loader import dequantize_mxfp4

    quant = dict(quant_method="mxfp4", modules_to_not_convert=["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"])
    packed, plain = rewritten(gpt_oss_dir, tmp_path / "mxfp4", quantization_config=quant), tmp_path / "dequantized"
    shutil.copytree(gpt_oss_dir, plain)
    tensors, gen = load_file(gpt_oss_dir / "model.safetensors"), torch.Generator().manual_seed(7)
    dequantized = dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows, cols = tensors.pop(name).shape
        blocks = torch.randint(0, 256, (experts, cols, rows // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(119, 126, (experts, cols, rows // 32), generator=gen, dtype=torch.uint8)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
        assert torch.equal(dequantize_mxfp4(blocks, scales), dequantized[name])
    save_file(tensors, packed / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, plain / "model.safetensors", metadata={"format": "pt"})
    prompts = random_prompts(3, 20, 60, seed=37)
    expected = hf_greedy(plain, prompts, 16)
    assert expected != hf_greedy(gpt_oss_dir, prompts, 16)  # the experts' weights are the MXFP4 ones
    assert tokens(LLM(packed, max_num_batched_tokens=32).generate(prompts, GREEDY)) == expected
    name = "model.layers.1.mlp.experts.down_proj_scales"
    for wrong, message in ((tensors[name][:, :, :1], r"_scales \[4, 64, 1\]: MXFP4 experts need"),
                           (tensors[name][:3], r"_scales \[3, 64, 4\]: MXFP4 experts need")):
        save_file({**tensors, name: wrong.contiguous()}, packed / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match=message):
            LLM(packed)
    llama = rewritten(gpt_oss_dir, tmp_path / "llama", architectures=["LlamaForCausalLM"], model_type="llama",
                      quantization_config=quant)
    with pytest.raises(ValueError, match=r"quantization_config \(mxfp4\).*not supported"):
        read_model_config(llama)
