"""How an embedding model folder pools its final hidden states into one vector (/v1/embeddings): as
its sentence-transformers files say (Qwen3-Embedding, gte-Qwen2), or — a bare base model without
them (e5-mistral's "MistralModel"), or any causal LM served for embeddings — by its last token,
L2-normalized, as vLLM serves such folders. Only what a causal engine computes is read: poolings
over the prompt's tokens as they are, never bidirectional attention."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from worker.models.config import BASE_MODELS

MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}  # sentence-transformers' flags
MODULES = (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"])  # modules.json's types, in order
TASKS = ("auto", "embed", "generate")


@dataclass(frozen=True)
class Pooling:
    """mode "last": the last prompt token's final hidden state; "mean": their mean over every prompt
    token. `normalize`: the vector L2-normalized (eps 1e-12, as torch.nn.functional.normalize).
    `dimensions` (Matryoshka): the lengths a request may cut the vector to; () any from 1 to the
    hidden size, None only the whole vector."""

    mode: str
    normalize: bool
    dimensions: tuple[int, ...] | None = None


LAST_NORMALIZED = Pooling("last", True)


def read_pooling(model_dir: str | Path, task: str = "auto") -> Pooling | None:
    """The folder's pooling, or None where it is served to generate: "auto" embeds a folder with
    sentence-transformers files or a bare base model; "embed" any folder (last token, normalized,
    where it says nothing); "generate" none."""
    if task not in TASKS:
        raise ValueError(f"task {task!r}: one of {', '.join(TASKS)}")
    if task == "generate":
        return None
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json")
    # EmbeddingGemma's flag, and the is_causal false of decoders trained to attend both ways
    for flag, bidirectional in (("use_bidirectional_attention", True), ("is_causal", False)):
        if config.get(flag, not bidirectional) == bidirectional:
            raise ValueError(f"{flag} {str(bidirectional).lower()} in {model_dir / 'config.json'}: bidirectional "
                             "attention is not supported (kvgate's engine attends causally)")
    if (model_dir / "modules.json").is_file():
        pooling = _sentence_transformers(model_dir)
    elif task == "embed" or any(name in BASE_MODELS for name in config.get("architectures") or []):
        pooling = LAST_NORMALIZED
    else:
        return None
    return replace(pooling, dimensions=_matryoshka(config))


def _sentence_transformers(model_dir: Path) -> Pooling:
    """The Transformer's states pooled as the Pooling module's config says, normalized where a
    Normalize module follows."""
    modules = _read_json(model_dir / "modules.json")
    types = [module.get("type", "").rpartition(".")[2] for module in modules]
    if types not in MODULES:
        raise ValueError(f"{model_dir / 'modules.json'} lists modules {types}: supported are Transformer, Pooling "
                         "and optionally Normalize, in that order")
    file = model_dir / modules[1]["path"] / "config.json"
    config = _read_json(file)
    chosen = [key for key, on in config.items() if key.startswith("pooling_mode_") and on]
    if len(chosen) != 1 or chosen[0] not in MODES:
        raise ValueError(f"{file} pools by {chosen or 'no mode'}: supported is exactly one of {', '.join(MODES)}")
    if not config.get("include_prompt", True):  # the instruction's tokens left out of the mean
        raise ValueError(f"{file} says include_prompt false: supported is pooling over every prompt token "
                         "(include_prompt true)")
    return Pooling(MODES[chosen[0]], normalize=types == MODULES[1])


def _matryoshka(config: dict) -> tuple[int, ...] | None:
    if config.get("matryoshka_dimensions") is not None:
        return tuple(config["matryoshka_dimensions"])
    return () if config.get("is_matryoshka") else None


def _read_json(file: Path):
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{file} is missing or unreadable: {e}") from e
