"""Reads a local Hugging Face folder: config.json (old and new spellings) and safetensors weights."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

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


def weight_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the shard index when there is one."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    names = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            names.update({name: file for name in f.keys()})
    return names


def load_weights(model: torch.nn.Module, model_dir: str | Path) -> None:
    """Copy every parameter from the checkpoint; fused params are the concatenation of their parts."""
    from safetensors import safe_open

    files = weight_files(model_dir)
    handles = {file: safe_open(str(file), "pt") for file in set(files.values())}
    missing = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            sources = [s if s in files else _fallback(s) for s in model.checkpoint_names(name)]
            if any(s not in files for s in sources):
                missing.append(name)
                continue
            tensors = [handles[files[s]].get_tensor(s) for s in sources]
            param.copy_(torch.cat(tensors, dim=0) if len(tensors) > 1 else tensors[0])
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights for {missing[:5]}")


def _fallback(name: str) -> str:
    """Some tied checkpoints still say tie_word_embeddings=false but store no lm_head."""
    return "model.embed_tokens.weight" if name == "lm_head.weight" else name


def load_model(model_dir: str | Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
               attention):
    """Build on the meta device (no init cost), materialise on `device`, then fill from safetensors."""
    from worker.models.llama import CausalLM

    with torch.device("meta"):
        model = CausalLM(cfg, attention).to(dtype)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty made two tensors of the one tied parameter
        model.lm_head.weight = model.model.embed_tokens.weight
    load_weights(model, model_dir)
    model.init_rope(device)
    return model.eval()
