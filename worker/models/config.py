"""A local Hugging Face folder's config.json, read into the one shape the model code uses (old and
new spellings alike).

Mistral is Llama's module with a sliding attention window (`layer_windows`: each layer's); Phi-3 is
Llama's with q/k/v and gate/up stored fused in the checkpoint (worker/models/loader.py reads its
parts from there) and RoPE over part of each head where it says so (Phi-4-mini: 3/4; `rotary_dim`);
Gemma 1, 2 and 3 are worker/models/gemma.py's, on the same attention; Mixtral, Qwen2-MoE and Qwen3-MoE are
Llama's, Qwen2's and Qwen3's with a sparse mixture of experts in place of the MLP (`moe`:
worker/models/moe.py); OLMo 2 and 3 are worker/models/olmo.py's (each branch normed after it, q and k
each normed across all their heads; OLMo 3's sliding layers on a RoPE of their own), OLMoE Llama's
with OLMo's q/k norms, q/k/v clipped and a mixture of experts; SmolLM3 Llama's with no RoPE in every
fourth layer (`rope_layers`); Ministral 3 Mistral's with its queries scaled past the original
context (`query_scaling`); gpt-oss worker/models/gpt_oss.py's (sinks in every attention, experts
with biases and a clamped SwiGLU; its MXFP4 experts dequantized as they load); GLM Llama's with
half of each head rotated, by adjacent pairs (`rope_interleaved`), and gate/up stored fused,
GLM-4-0414 with each branch's output normed too (`branch_norms`); OLMo 1 Llama's on LayerNorms
without weights, q/k/v clipped; Command R and R7B worker/models/cohere.py's (attention and MLP side
by side, RoPE by adjacent pairs; R7B's full layers unrotated); GLM-4.5 Llama's with half of each head
rotated (by halves), q/k norms where `use_qk_norm`, and experts past its first dense layers, routed
by sigmoid scores among the best groups, with shared experts (`MoeConfig.routing`); Granite 3 MoE
Granite's with experts (a shared MLP in the Shared variant); Phi-3.5-MoE worker/models/phimoe.py's
(LayerNorms with biases, a biased head, sparsemixer's routing); ERNIE 4.5 Llama's with RoPE by adjacent
pairs over the whole head and every linear biased where use_bias; EXAONE 4 worker/models/olmo.py's
(OLMo 2's norms after the branches, with Llama's norms, q/k normed per head, three sliding layers to
one full where it has a window, the full ones unrotated); Seed-OSS Llama's with o's bias apart from
q/k/v's (attention_out_bias); AFM worker/models/arcee.py's (a non-gated ReLU² MLP); StarCoder 2
worker/models/starcoder2.py's (biased LayerNorms, a non-gated GELU-tanh MLP, every linear biased);
StableLM 2 worker/models/stablelm.py's (biased LayerNorms, a quarter of each head rotated unless said,
per-head q/k LayerNorms and parallel residuals where it says); Hunyuan dense Llama's with q/k normed
per head after RoPE (`qk_norm_after_rope`), its "dynamic" RoPE with an alpha read as plain RoPE on a
stretched base (worker/models/hunyuan.py names its norms); Apertus worker/models/apertus.py's (a
non-gated xIELU MLP, q/k normed per head, Llama 3's RoPE on a base of 12M where it says nothing);
Llama 4 (its text model, from Llama4ForCausalLM and Llama4ForConditionalGeneration folders) Llama's
with RoPE by adjacent pairs, q/k normed per head without weights after RoPE in the rotated layers
only (`qk_norm` "weightless"), every fourth layer unrotated with its queries scaled by position
(`attn_temperature`), and experts in some layers, their inputs scaled by sigmoid weights, beside a
shared expert (worker/models/moe.py's InputScaledMoE); its rotated layers attend by chunks
(`layer_chunks`: a token sees only its own chunk of 8,192 tokens), which every attention path masks.
One thing caps the context served below the model's (`ModelConfig.context_cap`), where the model
computes exactly what kvgate computes and no further: LongRoPE (Phi-3's 128k variants, Phi-3.5-MoE),
whose short factors hold up to the original context and whose long ones, past it, would change every
position's rotation at once — which neither a paged cache nor a prefix cache can follow. What the
module cannot compute (partial rotary embeddings outside Phi-3, GLM and StableLM, an activation other
than its family's, dynamic NTK RoPE, an attention soft-cap outside Gemma 2, a quantized checkpoint
other than FP8 weights, GPTQ's, AWQ's and compressed-tensors' int4 and int8 weights, and gpt-oss's MXFP4
experts) is refused here, by name; the quantized ones read are dequantized as they load."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Phi3ForCausalLM": "phi3",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3",
                 "Gemma2ForCausalLM": "gemma2", "GraniteForCausalLM": "granite",
                 "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                 "Qwen3MoeForCausalLM": "qwen3_moe", "Olmo2ForCausalLM": "olmo2", "Olmo3ForCausalLM": "olmo3",
                 "OlmoeForCausalLM": "olmoe", "SmolLM3ForCausalLM": "smollm3", "Ministral3ForCausalLM": "ministral3",
                 "GptOssForCausalLM": "gpt_oss", "GemmaForCausalLM": "gemma", "GlmForCausalLM": "glm",
                 "Glm4ForCausalLM": "glm4", "OlmoForCausalLM": "olmo", "CohereForCausalLM": "cohere",
                 "Cohere2ForCausalLM": "cohere2", "Glm4MoeForCausalLM": "glm4_moe",
                 "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
                 "GraniteMoeForCausalLM": "granitemoe", "GraniteMoeSharedForCausalLM": "granitemoeshared",
                 "PhimoeForCausalLM": "phimoe", "PhiMoEForCausalLM": "phimoe",  # the Hub's Phi-3.5-MoE spelling
                 "Ernie4_5ForCausalLM": "ernie4_5", "Exaone4ForCausalLM": "exaone4",
                 "SeedOssForCausalLM": "seed_oss", "ArceeForCausalLM": "arcee",
                 "Starcoder2ForCausalLM": "starcoder2", "StableLmForCausalLM": "stablelm",
                 "HunYuanDenseV1ForCausalLM": "hunyuan_v1_dense", "ApertusForCausalLM": "apertus",
                 "Llama4ForCausalLM": "llama4"}
# a causal LM's bare base model, saved without its head (embedding folders: e5-mistral's "MistralModel"): its arch
BASE_MODELS = {name.removesuffix("ForCausalLM") + "Model": arch for name, arch in ARCHITECTURES.items()}
# a reranker's folder (Qwen3-Reranker-seq-cls, converted rerankers): the causal LM's body with a `score`
# head over its last token (worker/models/pooling.py reads the head)
CLASSIFIERS = {name.removesuffix("ForCausalLM") + "ForSequenceClassification": arch
               for name, arch in ARCHITECTURES.items()}
# image-and-text models whose text model is served (images are not): the folder's model_type, and
# the arch each text model_type is. Qwen2.5-VL's and Qwen3-VL's multimodal RoPE rotates a text-only
# sequence exactly as plain RoPE does (its three position axes are equal there). Llama 4's text_config
# is read as it stands (`_text_part`).
MULTIMODAL = {"Gemma3ForConditionalGeneration": "gemma3", "Mistral3ForConditionalGeneration": "mistral3",
              "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl", "Qwen3VLForConditionalGeneration": "qwen3_vl",
              "Llama4ForConditionalGeneration": "llama4"}
TEXT_MODELS = {"gemma3_text": "gemma3", "mistral": "mistral", "ministral3": "ministral3", "qwen2_5_vl_text": "qwen2",
               "qwen3_vl_text": "qwen3"}
QWEN2, QWEN3 = ("qwen2", "qwen2_moe"), ("qwen3", "qwen3_moe")  # a family's dense and sparse models
GEMMA = ("gemma2", "gemma3")  # worker/models/gemma.py's four norms a layer (Gemma 1's there too, with two)
OLMO = ("olmo2", "olmo3")  # worker/models/olmo.py; OLMoE is Llama's with their q/k norms
GLM = ("glm", "glm4")
COHERE = ("cohere", "cohere2")  # worker/models/cohere.py
PAIRWISE_ROPE = (*GLM, *COHERE, "ernie4_5", "llama4")  # RoPE by adjacent pairs (2i, 2i + 1), not halves
GRANITES = ("granite", "granitemoe", "granitemoeshared")  # Granite's four scalars, dense and sparse
DEEPSEEK = ("deepseek_v2", "deepseek_v3")  # worker/models/deepseek.py: multi-head latent attention
HALF_ROTARY = (*GLM, "glm4_moe")  # where the config says nothing, half of each head rotates
# families whose attention rotates part of each head where the config says
PARTIAL_ROTARY = ("phi3", *HALF_ROTARY, "stablelm")
# families whose transformers model attends the whole sequence whatever sliding_window says
NO_WINDOW = ("llama", "olmo", "olmo2", "olmoe", "gemma", *GLM, "glm4_moe", "cohere", "granitemoe", "granitemoeshared",
             "ernie4_5", "seed_oss", "arcee", "stablelm", "hunyuan_v1_dense", "apertus", "llama4")
TWO_ROPES = ("gemma3", "olmo3")  # sliding layers rotated by a RoPE of their own
GRANITE = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
ORIGINAL_CONTEXT = ("llama3", "yarn", "longrope")  # RoPE types that extend a pre-training context
APERTUS_ROPE = {"rope_type": "llama3", "rope_theta": 12_000_000.0, "factor": 8.0,
                "original_max_position_embeddings": 8192, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@dataclass(frozen=True)
class MoeConfig:
    """A sparse mixture of experts, routed as transformers routes each family (`routing`): "softmax"
    (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) over the router's logits in fp32, the top k experts, their
    weights renormalised to sum to 1 where `norm_topk_prob` (always in Mixtral), cast to the model's
    dtype except in Mixtral; "top_k_softmax" (Granite) a softmax over the top k's logits;
    "grouped_sigmoid" (GLM-4.5, DeepSeek-V3) sigmoid scores, chosen with a correction bias among the best
    groups; "group_limited_softmax" (DeepSeek-V2) a softmax's top k, among the best groups where it has them;
    "sparsemixer" (Phi-3.5-MoE) two picks, each weighted by a softmax over the scores near it;
    "sigmoid_inputs" (Llama 4) the top k logits' sigmoids, each scaling its expert's input, not its output."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool
    weights_fp32: bool  # Mixtral and GLM multiply by the fp32 weights; the Qwens cast them first
    shared_intermediate_size: int | None  # a shared expert every row goes through (Qwen2-MoE, GLM, Granite), else None
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP of intermediate_size
    routing: str = "softmax"  # one of worker/models/moe.py's ROUTERS
    shared_gate: bool = False  # Qwen2-MoE's shared expert's output x sigmoid(shared_expert_gate(x))
    groups: tuple[int, int] = (1, 1)  # GLM: (n_group, topk_group), the experts chosen from the best groups
    scaling: float = 1.0  # GLM: routed_scaling_factor, on the chosen experts' weights
    jitter_eps: float = 0.0  # Phi-3.5-MoE: router_jitter_noise, how near the best a score is softmaxed with it


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek's multi-head latent attention (worker/models/deepseek.py): q straight from the hidden
    state, or through a rank-`q_lora_rank` bottleneck; K and V of every head from one shared latent
    of kv_lora_rank values (normed), K's heads qk_nope_head_dim wide plus a qk_rope_head_dim rotated
    part shared by all heads, V's heads v_head_dim wide."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class Fp8Scales:
    """How an FP8 checkpoint scales its weights: each weight's scale is the tensor `<weight><suffix>`,
    one number a block of `block` (rows, columns); with no block, the scale's own shape says — one
    number for the tensor, or one an output row."""

    suffix: str
    block: tuple[int, int] | None


@dataclass(frozen=True)
class IntWeights:
    """How an int4 or int8 checkpoint packs its linears' weights (worker/models/int_weights.py reads
    them, dequantized to the serving dtype as they load): "gptq" (`qweight` packed along the input,
    `qzeros`, `scales`, optional `g_idx`), "awq" (AutoAWQ's GEMM layout, packed along the output in its
    interleaved order) or "pack-quantized" (compressed-tensors': `weight_packed`, `weight_scale`,
    optional `weight_zero_point` and `weight_g_idx`). Each value is (q - zero) x scale of its group of
    input rows."""

    method: str  # "gptq", "awq" or "pack-quantized"
    bits: int  # 4 or 8: 32 / bits values an int32
    group_size: int | None  # input rows a scale covers; None: all of them (GPTQ's -1, a channel's scale)
    zero_offset: int = 0  # GPTQ's classic format stores each zero less 1 (gptq_v2 the zero itself)
    symmetric: bool = True  # compressed-tensors: without a zero point, each value's zero is 2^(bits - 1)
    act_order: bool = False  # groups in activation order: each input row's group is in its g_idx tensor


@dataclass
class ModelConfig:
    arch: str  # one of ARCHITECTURES' values
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # the leading values of each head RoPE rotates (Phi-3's and GLM's partial_rotary_factor)
    intermediate_size: int
    rms_norm_eps: float  # every norm's epsilon (Cohere's LayerNorms' too: its layer_norm_eps)
    rope_theta: float
    rope_scaling: dict | None  # None for plain RoPE, else has "rope_type" (one of ROPE_TYPES)
    max_position_embeddings: int
    layer_windows: tuple[int | None, ...]  # each layer's sliding window (None: it attends the whole sequence)
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: str | None  # "head": each head normed alone (Qwen3, Gemma 3; Command R+'s with weights of its own);
    # "whole": q and k each across all their heads at once (OLMo 2, 3, OLMoE); "weightless": each head
    # RMS-normed alone with no weight, in the rotated layers only (Llama 4's use_qk_norm); None: no q/k norm
    dtype: str | None  # as the checkpoint was saved
    # Gemma 2 and 3 (worker/models/gemma.py): attention scaled by query_pre_attn_scalar^-0.5, not
    # head_dim's; logits soft-capped (tanh(x / cap) * cap), Gemma 2's attention scores too; Gemma 3's
    # sliding layers rotate by their own RoPE base (OLMo 3's too: local_rope_theta, unscaled)
    query_pre_attn_scalar: float | None = None
    logit_softcap: float | None = None
    local_rope_theta: float | None = None
    attn_softcap: float | None = None
    moe: MoeConfig | None = None  # the sparse MLP of a mixture-of-experts model
    # Granite (Llama's layers, four scalars): embeddings x embedding_multiplier, each residual branch
    # x residual_multiplier, scores scaled by attention_multiplier (not head_dim^-0.5), logits / logits_scaling
    multipliers: dict[str, float] | None = None
    post_norm: bool = False  # OLMo 2 and 3: each branch's output normed before its residual add, none before
    rope_layers: tuple[bool, ...] | None = None  # SmolLM3: which layers rotate (the rest: no position encoding)
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip_qkv, clip_qkv] after the q/k norms
    # Ministral 3 (Llama 4's scaling): (beta, original context); rotated queries x 1 + beta ln(1 +
    # floor(position / original context))
    query_scaling: tuple[float, int] | None = None
    # Llama 4's temperature tuning (attn_scale, floor_scale): its unrotated layers' queries x 1 + attn_scale
    # ln(1 + floor((position + 1) / floor_scale)); the rotated layers' as they are
    attn_temperature: tuple[float, float] | None = None
    # Llama 4: each layer's attention chunk where it attends by chunks (a token at p sees keys
    # [p - p % chunk, p] only), None where it attends the whole sequence; None for other models
    layer_chunks: tuple[int | None, ...] | None = None
    # gpt-oss: a learned sink logit per attention head; its experts' SwiGLU (alpha, limit): gate
    # clamped above at limit, up to [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate)
    attn_sinks: bool = False
    swiglu: tuple[float, float] | None = None
    # GLM and Cohere: RoPE turns each head's adjacent pairs (2i, 2i + 1), not its halves (i, i + rotary_dim / 2)
    rope_interleaved: bool = False
    branch_norms: bool = False  # GLM-4-0414: each branch's output RMS-normed too, before its residual add
    parallel_residual: bool = False  # StableLM's use_parallel_residual: attention and MLP from one norm, side by side
    qk_norm_after_rope: bool = False  # Hunyuan: q and k normed per head once rotated (elsewhere before)
    logit_scale: float | None = None  # Cohere: logits x it
    lm_head_bias: bool = False  # Phi-3.5-MoE: the head has a bias
    fp8: Fp8Scales | None = None  # how an FP8 checkpoint's weights are scaled (dequantized as they load)
    int_weights: IntWeights | None = None  # how an int4/int8 checkpoint packs its weights (dequantized as they load)
    mla: MlaConfig | None = None  # DeepSeek-V2 and V3: multi-head latent attention in place of q/k/v

    def local_rope(self, layer: int) -> bool:
        """Whether a layer rotates by the sliding layers' own RoPE (Gemma 3's and OLMo 3's sliding layers)."""
        return self.layer_windows[layer] is not None and self.local_rope_theta is not None

    @property
    def sliding_window(self) -> int | None:
        """The widest window any layer slides (None: every layer attends the whole sequence)."""
        return max((w for w in self.layer_windows if w), default=None)

    @property
    def max_context(self) -> int:
        """The longest sequence served: the model's context, or its cap."""
        cap = self.context_cap()
        return self.max_position_embeddings if cap is None else cap[0]

    def context_cap(self) -> tuple[int, str] | None:
        """(tokens, why) of the lowest limit below the model's context that kvgate serves it within, if any."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") != "longrope":
            return None
        cap = scaling.get("original_max_position_embeddings", self.max_position_embeddings)
        # past it: the long factors, for every position
        return (cap, "LongRoPE original context") if cap < self.max_position_embeddings else None


def read_model_config(model_dir: str | Path) -> ModelConfig:
    """One reader for both spellings: transformers 5 writes `dtype`/`rope_parameters`, older ones not."""
    raw = _text_part(json.loads((Path(model_dir) / "config.json").read_text()))
    arch = _arch(raw)
    heads = raw["num_attention_heads"]
    head_dim = (raw.get("head_dim") if arch != "stablelm" else None) or _HEAD_DIM.get(arch) \
        or raw["hidden_size"] // heads  # StableLM's: always hidden_size / heads
    max_position_embeddings = raw.get("max_position_embeddings", 2048)
    windows = tuple(_layer_windows(raw, arch))
    theta, scaling, local_theta = (_two_ropes(raw, arch, max_position_embeddings) if arch in TWO_ROPES
                                   else (*_rope(raw, arch, max_position_embeddings), None))
    gemma = arch in GEMMA
    _refuse_what_differs(raw, arch, scaling, head_dim)
    qkv_bias, o_bias, mlp_bias = _biases(raw, arch)
    cfg = ModelConfig(
        arch=arch, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"], num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim, rotary_dim=int(head_dim * _partial_rotary(raw, arch)),
        intermediate_size=raw["intermediate_size"],
        rms_norm_eps=_norm_eps(raw, arch),
        rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=max_position_embeddings, layer_windows=windows,
        tie_word_embeddings=raw.get("tie_word_embeddings", gemma or arch in _TIED),
        qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
        qk_norm="head" if arch in (*QWEN3, "gemma3", "exaone4", "hunyuan_v1_dense", "apertus")
        or (arch in ("cohere", "glm4_moe") and raw.get("use_qk_norm"))
        or (arch == "stablelm" and raw.get("qk_layernorm"))
        else "whole" if arch in (*OLMO, "olmoe") else None,
        dtype=raw.get("dtype") or raw.get("torch_dtype"),
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar", 256) if gemma else None,
        logit_softcap=raw.get("final_logit_softcapping") if gemma else None,
        local_rope_theta=local_theta, moe=_moe(raw, arch),
        attn_softcap=raw.get("attn_logit_softcapping") if arch == "gemma2" else None,
        multipliers={name: float(raw.get(name, 1.0)) for name in GRANITE} if arch in GRANITES else None,
        post_norm=arch in (*OLMO, "exaone4"),
        # Command R7B rotates in its sliding layers only (its full ones have no position encoding)
        rope_layers=_rope_layers(raw) if arch == "smollm3" else tuple(w is not None for w in windows)
        if arch == "cohere2" or (arch == "exaone4" and _window(raw, arch)) else None,
        clip_qkv=raw.get("clip_qkv") if arch in ("olmo", "olmoe") else None,
        query_scaling=_query_scaling(raw) if arch == "ministral3" else None,
        attn_sinks=arch == "gpt_oss",
        swiglu=(float(raw.get("swiglu_alpha", 1.702)), float(raw.get("swiglu_limit", 7.0))) if arch == "gpt_oss"
        else None,
        rope_interleaved=arch in PAIRWISE_ROPE, branch_norms=arch == "glm4",
        parallel_residual=arch == "stablelm" and bool(raw.get("use_parallel_residual", False)),
        qk_norm_after_rope=arch == "hunyuan_v1_dense",
        logit_scale=float(raw.get("logit_scale", 0.0625)) if arch in COHERE else None,
        lm_head_bias=arch == "phimoe" and bool(raw.get("lm_head_bias", False)),
        fp8=_fp8(raw.get("quantization_config")),
        int_weights=_int_weights(raw.get("quantization_config")),
    )
    if arch in DEEPSEEK:
        return _latent_attention(raw, cfg)
    return _llama4(raw, cfg) if arch == "llama4" else cfg


def _norm_eps(raw: dict, arch: str) -> float:
    """Every norm's epsilon, as each family's config names it and defaults it."""
    if arch in COHERE:
        return raw.get("layer_norm_eps", 1e-5)
    if arch == "starcoder2":
        return raw.get("norm_epsilon", 1e-5)
    if arch == "stablelm":
        return raw.get("layer_norm_eps", 1e-5)
    return raw.get("rms_norm_eps", 1e-5 if arch in ("ernie4_5", "exaone4", "arcee", "hunyuan_v1_dense", "apertus",
                                                    "llama4") else 1e-6)


def _biases(raw: dict, arch: str) -> tuple[bool, bool, bool]:
    """Whether q/k/v, o and the MLP's linears have biases, as each family's config names them and
    defaults them: Qwen2's q/k/v always; GLM's q/k/v unless said, its o never; ERNIE 4.5's all three
    by one flag (use_bias; StarCoder 2's too, on unless said); Seed-OSS's q/k/v unless said, its o by
    a flag of its own (attention_out_bias)."""
    if arch in QWEN2:
        return True, False, raw.get("mlp_bias", False)
    if arch == "stablelm":
        return bool(raw.get("use_qkv_bias", False)), False, False
    if arch in ("hunyuan_v1_dense", "apertus"):  # attention_bias on q/k/v and o alike; the MLP never
        return (bool(raw.get("attention_bias", False)),) * 2 + (False,)
    if arch in ("ernie4_5", "starcoder2"):
        return (raw.get("use_bias", arch == "starcoder2"),) * 3
    if arch == "seed_oss":
        return raw.get("attention_bias", True), raw.get("attention_out_bias", False), raw.get("mlp_bias", False)
    qkv = raw.get("attention_bias", arch in GLM)
    return qkv, bool(qkv) and arch not in (*GLM, "glm4_moe"), raw.get("mlp_bias", False)


FP8_METHODS = ("fp8", "compressed-tensors", "fbgemm_fp8")


def _fp8(quant) -> Fp8Scales | None:
    """FP8 weights, read as transformers reads each format (then dequantized to the serving dtype, what
    its `dequantize=True` computes): "fp8" (Qwen3-*-FP8, DeepSeek-V3) float8 e4m3 weights with
    `<weight>_scale_inv`, one scale per `weight_block_size` block; "compressed-tensors" in its
    "float-quantized" format (llm-compressor's FP8, FP8-dynamic) with `<weight>_scale` per tensor, per
    output channel or per block (`block_structure`); "fbgemm_fp8" (Meta's Llama 3.1 405B FP8) per
    output channel. The activations are not quantized: they stay in the serving dtype."""
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method not in FP8_METHODS:
        return None
    if method == "fbgemm_fp8":
        return Fp8Scales("_scale", None)
    if method == "fp8":
        block, fmt = quant.get("weight_block_size"), quant.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config fp8 with fmt {fmt!r}: only e4m3 weights are read")
        return Fp8Scales("_scale_inv", _block(block, "quantization_config fp8 needs weight_block_size"))
    if quant.get("format") == "pack-quantized":  # int weights: `_int_weights`
        return None
    if quant.get("format") != "float-quantized":
        raise ValueError(f"quantization_config compressed-tensors in format {quant.get('format')!r}: only "
                         "\"float-quantized\" (FP8 weights) and \"pack-quantized\" (int4 and int8 weights) are read")
    weights = [group.get("weights") or {} for group in (quant.get("config_groups") or {}).values()]
    if not weights or any((w.get("type"), w.get("num_bits")) != ("float", 8) for w in weights):
        raise ValueError("quantization_config compressed-tensors: every config group's weights must be 8-bit "
                         f"floats (here {[(w.get('type'), w.get('num_bits')) for w in weights]})")
    blocks = {tuple(w.get("block_structure") or ()) for w in weights if w.get("strategy") == "block"}
    if len(blocks) > 1 or any(w.get("strategy") not in ("tensor", "channel", "block") for w in weights):
        raise ValueError("quantization_config compressed-tensors: weights scaled per tensor, per channel or in "
                         f"one block shape are read (here {[w.get('strategy') for w in weights]}, blocks {blocks})")
    block = _block(list(blocks.pop()), "compressed-tensors' block_structure") if blocks else None
    return Fp8Scales("_scale", block)


INT_METHODS = ("gptq", "awq")  # and compressed-tensors' pack-quantized format
AWQ_GEMM = ("gemm", "exllama", "ipex")  # AutoAWQ versions saved in the GEMM layout (their kernels repack it)


def _int_weights(quant) -> IntWeights | None:
    """Int4 and int8 weights, read as each format's own dequantization computes them, then dequantized to
    the serving dtype as they load (no int kernels: the model takes its unquantized memory): "gptq"
    (AutoGPTQ's and GPTQModel's: Qwen's -GPTQ-Int4 and -Int8, TheBloke's) 4 or 8 bits, grouped by
    group_size or by each row's g_idx (desc_act), its classic format (each zero stored less 1) or
    gptq_v2; "awq" (AutoAWQ's GEMM layout: Qwen2.5's -AWQ, TheBloke's) 4 bits; compressed-tensors'
    "pack-quantized" (llm-compressor's W4A16 and W8A16) grouped or per channel, with or without zero
    points. Activations stay in the serving dtype. Refused by name: 2- and 3-bit GPTQ, layouts packed
    for one kernel (GPTQModel's marlin, AWQ's gemv and marlin), llm-awq's, per-module bits."""
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method == "gptq":
        return _gptq(quant)
    if method == "awq":
        return _awq(quant)
    if method == "compressed-tensors" and quant.get("format") == "pack-quantized":
        return _pack_quantized(quant)
    return None


def _gptq(quant: dict) -> IntWeights:
    bits = quant.get("bits")
    fmt = quant.get("checkpoint_format") or quant.get("format") or "gptq"  # GPTQModel's older name: format
    fmt = "marlin" if quant.get("is_marlin_format") else fmt  # AutoGPTQ's older flag for it
    if bits not in (4, 8):
        raise ValueError(f"quantization_config gptq with bits {bits!r}: 4- and 8-bit weights are read (not 2 or 3)")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config gptq in checkpoint_format {fmt!r}: the gptq and gptq_v2 layouts are "
                         "read (not one repacked for a kernel)")
    if quant.get("pack_dtype", "int32") != "int32" or quant.get("dynamic"):
        raise ValueError(f"quantization_config gptq with pack_dtype {quant.get('pack_dtype')!r} and dynamic "
                         f"{quant.get('dynamic')!r}: weights packed in int32, with one bits and group_size for "
                         "every linear, are read")
    return IntWeights("gptq", bits, _group_size(quant.get("group_size", 128), "gptq"),
                      zero_offset=1 if fmt == "gptq" else 0, act_order=bool(quant.get("desc_act")))


def _awq(quant: dict) -> IntWeights:
    version, bits = str(quant.get("version", "gemm")).lower(), quant.get("bits", quant.get("w_bit"))
    backend = quant.get("backend", "autoawq")
    if version not in AWQ_GEMM or backend != "autoawq":
        raise ValueError(f"quantization_config awq version {version!r} (backend {backend!r}): AutoAWQ's GEMM "
                         f"layout is read (versions {', '.join(AWQ_GEMM)}), not gemv's, marlin's or llm-awq's")
    if bits != 4 or not quant.get("zero_point", True):
        raise ValueError(f"quantization_config awq with bits {bits!r} and zero_point "
                         f"{quant.get('zero_point', True)!r}: 4-bit weights with zero points are read")
    return IntWeights("awq", 4, _group_size(quant.get("group_size", quant.get("q_group_size", 128)), "awq"))


def _pack_quantized(quant: dict) -> IntWeights:
    sparsity, transforms = (quant.get("sparsity_config") or {}).get("format", "dense"), quant.get("transform_config")
    if sparsity != "dense" or transforms:
        raise ValueError(f"quantization_config compressed-tensors pack-quantized with sparsity_config format "
                         f"{sparsity!r} and transform_config {transforms!r}: dense weights, not rotated, are read")
    weights = [group.get("weights") or {} for group in (quant.get("config_groups") or {}).values()]
    kinds = {(w.get("type"), w.get("num_bits"), w.get("strategy"), w.get("group_size"), w.get("symmetric", True),
              w.get("actorder")) for w in weights}
    if len(kinds) != 1:
        raise ValueError("quantization_config compressed-tensors pack-quantized: config groups whose weights are "
                         f"quantized alike are read (here {sorted(map(str, kinds))})")
    kind, bits, strategy, size, symmetric, order = kinds.pop()
    if kind != "int" or bits not in (4, 8) or strategy not in ("group", "channel"):
        raise ValueError(f"quantization_config compressed-tensors pack-quantized with {bits}-bit {kind} weights "
                         f"by {strategy}: 4- and 8-bit int weights, by group or channel, are read")
    group = _group_size(size, "compressed-tensors") if strategy == "group" else None
    return IntWeights("pack-quantized", bits, group, symmetric=bool(symmetric),
                      act_order=order in ("group", "dynamic"))


def _group_size(size, method: str) -> int | None:
    if size == -1:
        return None
    if type(size) is not int or size <= 0:
        raise ValueError(f"quantization_config {method} group_size {size!r}: a positive number of input rows "
                         "(or -1, all of them) is read")
    return size


def _block(block, what: str) -> tuple[int, int]:
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and 0 < b <= 1 << 16 for b in block)):
        raise ValueError(f"{what} [rows, columns] (here {block!r})")
    return block[0], block[1]


def _moe(raw: dict, arch: str) -> MoeConfig | None:
    """Mixtral's, OLMoE's, gpt-oss's, Granite's and Phi-3.5-MoE's experts are intermediate_size wide and in
    every layer; the Qwens' are moe_intermediate_size wide, in every decoder_sparse_step-th layer not in
    mlp_only_layers; GLM-4.5's moe_intermediate_size wide, in the layers from first_k_dense_replace on.
    (gpt-oss's routing, a softmax over the top k's logits, is the renormalised top k of the softmax.)"""
    if arch in DEEPSEEK:
        return _deepseek_moe(raw, arch)
    if arch not in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "glm4_moe", "granitemoe",
                    "granitemoeshared", "phimoe"):
        return None
    experts = raw.get("num_local_experts") or raw.get("num_experts") or raw.get("n_routed_experts")
    top_k, layers = raw.get("num_experts_per_tok", 8 if arch == "glm4_moe" else 2), raw["num_hidden_layers"]
    if not experts or not 0 < top_k <= experts:
        raise ValueError(f"a {arch} folder needs num_experts (here {experts}) and 0 < num_experts_per_tok "
                         f"<= it (here {top_k}) in config.json")
    every = (True,) * layers
    if arch == "mixtral":
        return MoeConfig(experts, top_k, raw["intermediate_size"], True, True, None, every)
    if arch == "olmoe":
        return MoeConfig(experts, top_k, raw["intermediate_size"], bool(raw.get("norm_topk_prob", False)), False,
                         None, every)
    if arch == "gpt_oss":
        return MoeConfig(experts, top_k, raw["intermediate_size"], True, False, None, every)
    if arch == "glm4_moe":
        return _glm4_moe(raw, experts, top_k)
    if arch in ("granitemoe", "granitemoeshared"):  # the shared MLP beside the experts, as one more expert
        shared = raw.get("shared_intermediate_size", 0) if arch == "granitemoeshared" else 0
        return MoeConfig(experts, top_k, raw["intermediate_size"], False, False, shared or None, every,
                         routing="top_k_softmax")
    if arch == "phimoe":
        if top_k != 2:
            raise ValueError(f"num_experts_per_tok {top_k} in config.json: a phimoe folder's sparsemixer routes "
                             "each row to 2 experts")
        return MoeConfig(experts, 2, raw["intermediate_size"], False, False, None, every, routing="sparsemixer",
                         jitter_eps=float(raw.get("router_jitter_noise", 0.01)))
    step, dense = raw.get("decoder_sparse_step", 1) or 1, set(raw.get("mlp_only_layers") or ())
    shared = raw.get("shared_expert_intermediate_size") if arch == "qwen2_moe" else None
    return MoeConfig(experts, top_k, raw["moe_intermediate_size"], bool(raw.get("norm_topk_prob", False)), False,
                     shared or None, tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
                     shared_gate=arch == "qwen2_moe")


def _glm4_moe(raw: dict, experts: int, top_k: int) -> MoeConfig:
    """GLM-4.5's experts as Glm4MoeConfig's defaults fill in what the folder leaves out; groups that
    transformers' router cannot split (two best scores a group) refused by name. The MTP layers a
    released checkpoint holds past num_hidden_layers (num_nextn_predict_layers) are not served."""
    width, groups, chosen = raw.get("moe_intermediate_size", 1408), raw.get("n_group", 1), raw.get("topk_group", 1)
    if experts % groups or experts // groups < 2 or not 0 < chosen <= groups or top_k > chosen * experts // groups:
        raise ValueError(f"n_group {groups} and topk_group {chosen} in config.json: a glm4_moe folder's router "
                         f"needs n_group to divide its {experts} experts into groups of 2 or more, and its "
                         f"{top_k} experts a row within topk_group <= n_group groups")
    first_sparse, shared = raw.get("first_k_dense_replace", 1), raw.get("n_shared_experts", 1) * width
    return MoeConfig(experts, top_k, width, bool(raw.get("norm_topk_prob", True)), True, shared or None,
                     tuple(i >= first_sparse for i in range(raw["num_hidden_layers"])), routing="grouped_sigmoid",
                     groups=(groups, chosen), scaling=float(raw.get("routed_scaling_factor", 1.0)))


def _latent_attention(raw: dict, cfg: ModelConfig) -> ModelConfig:
    """DeepSeek-V2's and V3's attention as their config classes' defaults fill in what the folder leaves
    out. The cache holds every head's K and V (num_key_value_heads is not read: the latent expands
    into every head) at one head size, the wider of K's and V's (the other zero-padded); RoPE turns
    the rotated part by adjacent pairs (V2 always, V3 where rope_interleave, its default). DeepSeek-V3's
    FP8 release is read as every block-scaled FP8 folder is (dequantized as it loads). Refused: V2's
    mlp_bias (transformers biases its dense and shared MLPs, not its experts)."""
    if raw.get("mlp_bias"):
        raise ValueError(f"mlp_bias {raw['mlp_bias']!r} in config.json is not supported for a {cfg.arch} folder")
    mla = MlaConfig(raw.get("q_lora_rank", 1536), raw.get("kv_lora_rank", 512), raw.get("qk_nope_head_dim", 128),
                    raw.get("qk_rope_head_dim", 64), raw.get("v_head_dim", 128))
    return replace(cfg, mla=mla, head_dim=max(mla.qk_head_dim, mla.v_head_dim), num_kv_heads=cfg.num_heads,
                   rotary_dim=mla.qk_rope_head_dim,
                   rope_interleaved=cfg.arch == "deepseek_v2" or bool(raw.get("rope_interleave", True)),
                   mlp_bias=False)


def _deepseek_moe(raw: dict, arch: str) -> MoeConfig:
    """DeepSeek-V3's experts routed as GLM-4.5's (grouped sigmoid, correction bias), V2's by a softmax's
    top k ("greedy"), or its top k within the best groups, each valued by its best score
    ("group_limited_greedy"), never renormalised; both x routed_scaling_factor, with shared experts, past
    first_k_dense_replace dense layers. What transformers' modules do not read (V2's norm_topk_prob, a
    moe_layer_freq other than 1) is refused, as are groups its routers cannot split."""
    v3 = arch == "deepseek_v3"
    experts, top_k = raw.get("n_routed_experts", 256 if v3 else 64), raw.get("num_experts_per_tok", 8 if v3 else None)
    method = "noaux_tc" if v3 else raw.get("topk_method", "greedy")
    if not v3 and method not in ("greedy", "group_limited_greedy"):  # V3's is noaux_tc whatever its config says
        raise ValueError(f"topk_method {method!r} in config.json: a deepseek_v2 folder's router is 'greedy' or "
                         "'group_limited_greedy'")
    if not top_k or not 0 < top_k <= experts:
        raise ValueError(f"a {arch} folder needs n_routed_experts (here {experts}) and 0 < num_experts_per_tok "
                         f"<= it (here {top_k}) in config.json")
    for name, served in (("moe_layer_freq", 1), ("norm_topk_prob", None if v3 else False)):
        if served is not None and raw.get(name, served) != served:
            raise ValueError(f"{name} {raw[name]!r} in config.json: a {arch} folder is served as transformers "
                             f"computes it, with {name} {served!r}")
    groups, chosen = (raw.get("n_group", 8 if v3 else 1), raw.get("topk_group", 4 if v3 else 1)) if method != "greedy" \
        else (1, 1)
    smallest = 2 if v3 else 1  # V3 values a group by its two best scores
    if experts % groups or experts // groups < smallest or not 0 < chosen <= groups \
            or top_k > chosen * experts // groups:
        raise ValueError(f"n_group {groups} and topk_group {chosen} in config.json: a {arch} folder's router "
                         f"needs n_group to divide its {experts} experts into groups of {smallest} or more, and "
                         f"its {top_k} experts a row within topk_group <= n_group groups")
    width = raw.get("moe_intermediate_size", 2048 if v3 else 1407)
    shared = raw.get("n_shared_experts", 1 if v3 else 2) or 0
    first_sparse = raw.get("first_k_dense_replace", 3 if v3 else 0)
    return MoeConfig(experts, top_k, width, v3 and bool(raw.get("norm_topk_prob", True)), True, shared * width or None,
                     tuple(i >= first_sparse for i in range(raw["num_hidden_layers"])),
                     routing="grouped_sigmoid" if v3 else "group_limited_softmax", groups=(groups, chosen),
                     scaling=float(raw.get("routed_scaling_factor", 2.5 if v3 else 1.0)))


def _llama4(raw: dict, cfg: ModelConfig) -> ModelConfig:
    """Llama 4's text model as Llama4TextConfig's defaults fill in what the folder leaves out: NoPE
    layers from no_rope_layers (1: rotated; absent or empty, every no_rope_layer_interval-th layer is
    not), their queries scaled by attn_temperature_tuning, q/k norms (use_qk_norm) in the rotated
    layers, which attend by chunks of attention_chunk_size (layer_types where it says); experts in
    moe_layers (or every interleave_moe_layer_step-th layer), intermediate_size wide as the shared
    expert, the dense layers intermediate_size_mlp wide. A layer kind transformers' Llama 4 has no
    mask for is refused, as is a chunked layer without a chunk size."""
    layers = cfg.num_layers
    flags = raw.get("no_rope_layers") or None  # Llama4TextConfig's: an empty list is the default too
    rope_layers = _rope_layers({**raw, "no_rope_layers": flags})
    chunk = raw.get("attention_chunk_size", 8192)
    kinds = raw.get("layer_types") or ["chunked_attention" if rope and chunk else "full_attention"
                                       for rope in rope_layers]
    if len(kinds) != layers or not set(kinds) <= {"chunked_attention", "full_attention"} \
            or ("chunked_attention" in kinds and not chunk):
        raise ValueError(f"layer_types {kinds} in config.json: a llama4 folder's {layers} layers are each "
                         "'chunked_attention' (with an attention_chunk_size) or 'full_attention'")
    return replace(
        cfg, intermediate_size=raw.get("intermediate_size_mlp", 16384), moe=_llama4_moe(raw, layers),
        qk_norm="weightless" if raw.get("use_qk_norm", True) else None, qk_norm_after_rope=True,
        rope_layers=rope_layers, layer_chunks=tuple(chunk if kind == "chunked_attention" else None for kind in kinds),
        # the Hub's Scout folders say attn_temperature_tuning 4: on, as transformers 4 read it
        attn_temperature=(float(raw.get("attn_scale", 0.1)), float(raw.get("floor_scale", 8192)))
        if raw.get("attn_temperature_tuning", True) else None)


def _llama4_moe(raw: dict, layers: int) -> MoeConfig:
    experts, top_k = raw.get("num_local_experts", 16), raw.get("num_experts_per_tok", 1)
    if not 0 < top_k <= experts:
        raise ValueError(f"a llama4 folder needs 0 < num_experts_per_tok <= num_local_experts (here {top_k} and "
                         f"{experts}) in config.json")
    sparse = raw.get("moe_layers")
    if sparse is None:  # (an empty list: no sparse layer)
        step = raw.get("interleave_moe_layer_step", 1)
        sparse = range(step - 1, layers, step)
    width = raw.get("intermediate_size", 8192)
    return MoeConfig(experts, top_k, width, False, False, width, tuple(i in set(sparse) for i in range(layers)),
                     routing="sigmoid_inputs")


def _text_part(raw: dict) -> dict:
    """A multimodal folder's text model's config (Gemma 3 4B and up, Mistral Small 3.1 and 3.2,
    Ministral 3, Qwen2.5-VL, Qwen3-VL): its text config as transformers builds it (the defaults hub
    configs leave out filled in; Qwen2.5-VL's older folders keep its fields at the top level), and
    what the folder says at the top; the text model's arch as `model_type`. Llama 4's text_config as
    it stands (`_llama4` fills in its defaults): transformers 5's strict config refuses the Hub's own
    Scout folders (their attn_temperature_tuning is 4, not a bool)."""
    kind = next((MULTIMODAL[name] for name in raw.get("architectures") or [] if name in MULTIMODAL), None)
    if kind is None:
        return raw
    top = {k: raw[k] for k in ("dtype", "torch_dtype", "quantization_config", "tie_word_embeddings") if k in raw}
    if kind == "llama4":
        return {**(raw.get("text_config") or {}), **top, "architectures": [], "model_type": "llama4"}
    from transformers import AutoConfig

    fields = {k: v for k, v in raw.items() if k not in ("model_type", "architectures")}
    text = AutoConfig.for_model(raw.get("model_type", kind), **fields).get_text_config()
    if text.model_type not in TEXT_MODELS:
        raise ValueError(f"{raw['architectures']} with a {text.model_type!r} text model is not supported; text "
                         f"models: {sorted(TEXT_MODELS)}")
    return {**text.to_dict(), **top, "architectures": [], "model_type": TEXT_MODELS[text.model_type]}


def _arch(raw: dict) -> str:
    for name in raw.get("architectures") or []:
        arch = ARCHITECTURES.get(name) or BASE_MODELS.get(name) or CLASSIFIERS.get(name)
        if arch:
            return arch
    if raw.get("model_type") in ARCHITECTURES.values():
        return raw["model_type"]
    raise ValueError(f"unsupported architecture {raw.get('architectures')}; supported: "
                     f"{sorted([*ARCHITECTURES, *MULTIMODAL])} each causal LM's base model (<X>Model) and its <X>ForSequenceClassification")


def _refuse_what_differs(raw: dict, arch: str, scaling: dict | None, head_dim: int) -> None:
    """A folder whose config asks for what the module does not compute fails to load, saying what."""
    kind = scaling["rope_type"] if scaling else "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {kind!r} in config.json ({arch}); supported: {', '.join(ROPE_TYPES)}")
    if arch == "phimoe" and kind not in ("default", "longrope"):
        raise ValueError(f"rope_type {kind!r} in config.json: a phimoe folder's RoPE is served plain or LongRoPE")
    partial = _partial_rotary(raw, arch)
    rot = int(head_dim * partial)
    if partial != 1.0 and (arch not in PARTIAL_ROTARY or rot % 2 or rot <= 0):
        raise ValueError(f"partial_rotary_factor {partial} in config.json: supported for Phi-3, GLM and StableLM "
                         "folders rotating an even number of each head's values; a "
                         f"{arch} folder's attention rotates all of them")
    if kind == "longrope":
        for name in ("short_factor", "long_factor"):
            if len(scaling.get(name) or ()) != rot // 2:
                raise ValueError(f"LongRoPE's {name} in config.json must have rotary dims / 2 = {rot // 2} "
                                 "numbers")
    quant = raw.get("quantization_config")
    method = (quant.get("quant_method", "unnamed") if isinstance(quant, dict) else "unnamed") if quant else None
    # dequantized as they load: gpt-oss's MXFP4 experts, FP8 weights (`_fp8`), int4 and int8 ones (`_int_weights`)
    if method and not (arch == "gpt_oss" and method == "mxfp4") and method not in (*FP8_METHODS, *INT_METHODS):
        raise ValueError(f"quantization_config ({method}) in config.json: quantized checkpoints are not "
                         "supported (but for FP8 weights — fp8, compressed-tensors, fbgemm_fp8 —, int4 and int8 "
                         "weights — gptq, awq, compressed-tensors' pack-quantized — and gpt-oss's MXFP4 experts); "
                         "serve the model's unquantized (bf16, fp16 or fp32) folder")
    act, wanted = _activation(raw, arch), _ACTIVATION.get(arch, "silu")
    if act != wanted:
        raise ValueError(f"hidden_act {act!r} in config.json: a {arch} folder's MLP is {wanted!r}")
    for name in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if raw.get(name) and not (name == "attn_logit_softcapping" and arch == "gemma2"):
            # Gemma 2's attention soft-cap elsewhere (Gemma 3's had none); Gemma 3's embedding variants
            raise ValueError(f"{name} {raw[name]!r} in config.json is not supported for a {arch} folder")


_ACTIVATION = {**dict.fromkeys(("gemma", *GEMMA), "gelu_pytorch_tanh"), "arcee": "relu2",
               "starcoder2": "gelu_pytorch_tanh", "apertus": "xielu"}  # every other: SiLU
# where a config leaves head_dim out: its class's default (not hidden_size / heads, as elsewhere)
_HEAD_DIM = {"gemma": 256, "gemma2": 256, "gemma3": 256, "glm": 128, "glm4": 128, "ernie4_5": 128, "seed_oss": 128,
             "llama4": 128}
_TIED = ("gemma", *GEMMA, "smollm3", *COHERE, "ernie4_5", "starcoder2")  # head = the embeddings unless said
_THETA = {"ernie4_5": 500_000.0, "llama4": 500_000.0}  # a family's rope_theta where its config says none (else 10,000)


def _activation(raw: dict, arch: str) -> str:
    """The MLP's activation as transformers reads it: Gemma 2's and 3's hidden_activation; Gemma 1's
    hidden_act, whose legacy "gelu" (the first releases' folders) GemmaConfig turns into the tanh GELU."""
    if arch == "gemma":
        act = raw.get("hidden_act", "gelu_pytorch_tanh")
        return "gelu_pytorch_tanh" if act == "gelu" else act
    return raw.get("hidden_activation") or raw.get("hidden_act", _ACTIVATION.get(arch, "silu"))


def _two_ropes(raw: dict, arch: str, max_position_embeddings: int) -> tuple[float, dict | None, float]:
    """Gemma 3's and OLMo 3's two RoPEs: (theta, scaling) of their full-attention layers and their
    sliding layers' theta, from transformers 5's rope_parameters per layer type or the older
    rope_theta and rope_scaling (the full layers'), with Gemma's rope_local_base_freq (OLMo 3's
    sliding layers: rope_theta, unscaled)."""
    params = raw.get("rope_parameters") or {}
    full_theta = raw.get("rope_theta", 1_000_000.0 if arch == "gemma3" else 500_000.0)
    full = params.get("full_attention") or {**(raw.get("rope_scaling") or {}), "rope_theta": full_theta}
    local_theta = raw.get("rope_local_base_freq", 10_000.0) if arch == "gemma3" else full_theta
    local = params.get("sliding_attention") or {"rope_theta": local_theta}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ValueError(f"a scaled RoPE on a {arch} folder's sliding layers is not supported")
    theta, scaling = _rope({"rope_parameters": full}, arch, max_position_embeddings)
    return theta, scaling, float(local.get("rope_theta", local_theta))


def _query_scaling(raw: dict) -> tuple[float, int]:
    """Ministral 3's query scaling, from its RoPE parameters (transformers reads both there)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    beta, context = params.get("llama_4_scaling_beta"), params.get("original_max_position_embeddings")
    if beta is None or not context:
        raise ValueError("a ministral3 folder's rope_parameters in config.json need llama_4_scaling_beta and "
                         "original_max_position_embeddings (its queries' scaling)")
    return float(beta), int(context)


def _rope_layers(raw: dict) -> tuple[bool, ...]:
    """SmolLM3's and Llama 4's rotating layers: no_rope_layers says 1 for each (its name
    notwithstanding), or every no_rope_layer_interval-th layer is the one without."""
    flags = raw.get("no_rope_layers")
    if flags is None:
        every = raw.get("no_rope_layer_interval", 4)
        return tuple((i + 1) % every != 0 for i in range(raw["num_hidden_layers"]))
    if len(flags) != raw["num_hidden_layers"]:
        raise ValueError(f"no_rope_layers in config.json has {len(flags)} entries for "
                         f"{raw['num_hidden_layers']} layers")
    return tuple(bool(f) for f in flags)


def _ntk_alpha(raw: dict, theta: float, scaling: dict) -> float:
    """Hunyuan's "dynamic" RoPE with an alpha, as transformers computes it: NTK by a fixed alpha, plain
    RoPE on a stretched base, the same at every length. Without an alpha it is dynamic NTK, whose
    frequencies change with the sequence's length — which neither a paged cache nor a prefix cache can
    follow: refused."""
    alpha = scaling.get("alpha")
    if not alpha:
        raise ValueError("rope_type 'dynamic' without an alpha in config.json: a hunyuan_v1_dense folder's "
                         "dynamic NTK RoPE is served only with alpha (its frequencies then fixed)")
    dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    return theta * alpha ** (dim / (dim - 2))


def _partial_rotary(raw: dict, arch: str) -> float:
    """The share of each head RoPE rotates: in rope_parameters (transformers 5) or top level; GLM's
    configs rotate half when they say nothing."""
    top = raw.get("partial_rotary_factor", 0.5 if arch in HALF_ROTARY else 0.25 if arch == "stablelm" else 1.0)
    return (raw.get("rope_parameters") or {}).get("partial_rotary_factor", top)


def _layer_windows(raw: dict, arch: str) -> list[int | None]:
    """Each layer's sliding window, or None where it attends the whole sequence. transformers 5
    names each layer's kind in `layer_types`; older Qwen configs say `use_sliding_window` (layers
    from `max_window_layers` on slide); Mistral, Mixtral and Phi-3 slide in every layer when they
    have one."""
    window, layers = _window(raw, arch), raw["num_hidden_layers"]
    if not window or arch in NO_WINDOW:
        return [None] * layers
    if arch == "smollm3":  # sliding where layer_types says, only if use_sliding_window; by default its NoPE layers
        kinds = raw.get("layer_types") or ["full_attention" if rope else "sliding_attention"
                                           for rope in _rope_layers(raw)]
        return [window if raw.get("use_sliding_window") and kind == "sliding_attention" else None for kind in kinds]
    if arch == "olmo3" and raw.get("layer_types") is None:  # three sliding layers, then a full one
        return [window if (i + 1) % 4 else None for i in range(layers)]
    if arch == "gpt_oss" and raw.get("layer_types") is None:  # sliding and full in turn, sliding first
        return [window if (i + 1) % 2 else None for i in range(layers)]
    if raw.get("layer_types") is not None:
        return [window if kind == "sliding_attention" else None for kind in raw["layer_types"]]
    if arch == "qwen3_moe":  # transformers' Qwen3-MoE slides in every layer when it slides at all
        return [window if raw.get("use_sliding_window", False) else None] * layers
    if arch == "qwen2_moe":  # and its Qwen2-MoE in every other layer below max_window_layers
        last = raw.get("max_window_layers", 28) if raw.get("use_sliding_window", False) else 0
        return [window if i < last and i % 2 == 0 else None for i in range(layers)]
    if arch in ("qwen2", "qwen3"):
        first = raw.get("max_window_layers", 28) if raw.get("use_sliding_window", False) else layers
        return [window if i >= first else None for i in range(layers)]
    if arch in (*GEMMA, "cohere2", "exaone4"):  # before layer_types: every sliding_window_pattern-th layer is full
        pattern = raw.get("sliding_window_pattern", {"gemma3": 6, "gemma2": 2}.get(arch, 4))
        return [window if (i + 1) % pattern else None for i in range(layers)]
    return [window] * layers


def _window(raw: dict, arch: str) -> int | None:
    """The config's sliding window, or its class's default: OLMo 3's, Command R7B's and EXAONE 4's 4,096."""
    return raw.get("sliding_window", 4096 if arch in ("olmo3", "cohere2", "exaone4") else None)


def _rope(raw: dict, arch: str, max_position_embeddings: int) -> tuple[float, dict | None]:
    """(theta, scaling): theta top-level or in rope_parameters; scaling in rope_scaling or
    rope_parameters, with what transformers fills in: the original context (a Phi-3's top-level
    field first), YaRN's and LongRoPE's missing `factor` as the ratio of the two contexts."""
    params = raw.get("rope_parameters") or {}
    if arch == "apertus" and not params and not raw.get("rope_scaling"):
        raw, params = {}, APERTUS_ROPE  # what ApertusConfig fills in without RoPE parameters, whatever rope_theta says
    scaling = raw.get("rope_scaling") or params
    theta = raw.get("rope_theta", params.get("rope_theta", _THETA.get(arch, 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if arch == "phi3" and rope_type in ("su", "yarn"):  # Phi-3's older names for LongRoPE
        rope_type = "longrope"
    if arch == "hunyuan_v1_dense" and rope_type == "dynamic":
        return _ntk_alpha(raw, float(theta), scaling), None
    if rope_type == "default":
        return float(theta), None
    kept = {k: v for k, v in scaling.items() if k not in ("type", "rope_type", "rope_theta", "partial_rotary_factor")}
    scaling = {**kept, "rope_type": rope_type}
    if rope_type in ORIGINAL_CONTEXT:
        top = raw.get("original_max_position_embeddings") or (4096 if arch == "phi3" else None)
        if top is not None:  # transformers gives a config's own field (Phi-3 has one by default) priority
            scaling["original_max_position_embeddings"] = top
        scaling.setdefault("original_max_position_embeddings", max_position_embeddings)
        if rope_type != "llama3" and scaling.get("factor") is None:
            scaling["factor"] = max_position_embeddings / scaling["original_max_position_embeddings"]
    # transformers' Phi-3.5-MoE scales cos and sin by short_mscale within the original context (by
    # long_mscale past it, where kvgate does not serve it: context_cap)
    if arch == "phimoe" and rope_type == "longrope":
        if not isinstance(scaling.get("short_mscale"), (int, float)):
            raise ValueError("a phimoe folder's longrope RoPE needs short_mscale (a number) in config.json")
        scaling["attention_factor"] = float(scaling["short_mscale"])
    return float(theta), scaling
