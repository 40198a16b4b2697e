"""A local Hugging Face folder's config.json, read into the one shape the model code uses (old and
new spellings alike)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


@dataclass
class ModelConfig:
    arch: str  # llama | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None for plain RoPE, else has "rope_type" (llama3, linear)
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    dtype: str | None  # as the checkpoint was saved


def read_model_config(model_dir: str | Path) -> ModelConfig:
    """One reader for both spellings: transformers 5 writes `dtype`/`rope_parameters`, older ones not."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    arch = _arch(raw)
    heads = raw["num_attention_heads"]
    theta, scaling = _rope(raw)
    bias = raw.get("attention_bias", False)
    return ModelConfig(
        arch=arch, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"], num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        intermediate_size=raw["intermediate_size"], rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        qkv_bias=True if arch == "qwen2" else bias, o_bias=False if arch == "qwen2" else bias,
        mlp_bias=raw.get("mlp_bias", False), qk_norm=arch == "qwen3",
        dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )


def _arch(raw: dict) -> str:
    for name in raw.get("architectures") or []:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if raw.get("model_type") in ARCHITECTURES.values():
        return raw["model_type"]
    raise ValueError(f"unsupported architecture {raw.get('architectures')}; supported: {sorted(ARCHITECTURES)}")


def _rope(raw: dict) -> tuple[float, dict | None]:
    """(theta, scaling): theta top-level or in rope_parameters; scaling in rope_scaling or rope_parameters."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type == "default":
        return float(theta), None
    kept = {k: v for k, v in scaling.items() if k not in ("type", "rope_type", "rope_theta")}
    return float(theta), {**kept, "rope_type": rope_type}
