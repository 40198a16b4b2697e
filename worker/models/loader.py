"""Builds a model from a local Hugging Face folder: the module from its config (worker/models/config.py),
the weights from its safetensors files."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from worker.models.config import ModelConfig
from worker.models.llama import CausalLM


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
    with torch.device("meta"):
        model = CausalLM(cfg, attention).to(dtype)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty made two tensors of the one tied parameter
        model.lm_head.weight = model.model.embed_tokens.weight
    load_weights(model, model_dir)
    model.init_rope(device)
    return model.eval()
