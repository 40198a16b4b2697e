"""How an embedding model folder pools its final hidden states into one vector (/v1/embeddings): as
its sentence-transformers files say (Qwen3-Embedding, gte-Qwen2), or — a bare base model without
them (e5-mistral's "MistralModel"), or any causal LM served for embeddings — by its last token,
L2-normalized, as vLLM serves such folders. Only what a causal engine computes is read: poolings
over the prompt's tokens as they are, never bidirectional attention.

A reranker (/v1/score, /v1/rerank) pools its last token too, and scores it: a sequence-classification
folder (`<X>ForSequenceClassification`, one label: Qwen3-Reranker-seq-cls) by its `score` head, a
causal LM served with task "score" by its LM head's rows for the answer tokens vLLM's
classifier_from_token names (Qwen3-Reranker: "no", "yes" — the score is P(yes) of the two; one token:
the sigmoid of its logit). Either way the score is sigmoid(w · state + b), `score_head` reads w and b."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from worker.models.config import BASE_MODELS, CLASSIFIERS

MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}  # sentence-transformers' flags
MODULES = (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"])  # modules.json's types, in order
TASKS = ("auto", "embed", "generate", "score")
ENCODER_TYPES = ("bert", "roberta", "xlm-roberta")  # config.json's model_type (worker/models/bert.py)
# configs whose logits are not the LM head's product as it stands: a score from its rows would differ
LOGIT_CHANGES = {"final_logit_softcapping": None, "logits_scaling": 1, "logit_scale": 1}


@dataclass(frozen=True)
class Pooling:
    """mode "last": the last prompt token's final hidden state; "mean": their mean over every prompt
    token. `normalize`: the vector L2-normalized (eps 1e-12, as torch.nn.functional.normalize).
    `dimensions` (Matryoshka): the lengths a request may cut the vector to; () any from 1 to the
    hidden size, None only the whole vector."""

    mode: str
    normalize: bool
    dimensions: tuple[int, ...] | None = None
    # a reranker's: the answer tokens whose LM-head rows score it, or () for a `score` head
    score_tokens: tuple[str, ...] | None = None

    @property
    def scores(self) -> bool:
        return self.score_tokens is not None


LAST_NORMALIZED = Pooling("last", True)


def read_pooling(model_dir: str | Path, task: str = "auto", score_tokens: tuple[str, ...] = ()) -> Pooling | None:
    """The folder's pooling, or None where it is served to generate: "auto" embeds a folder with
    sentence-transformers files or a bare base model, and scores with a sequence-classification
    folder; "embed" any folder (last token, normalized, where it says nothing); "score" a
    sequence-classification folder, or a causal LM by `score_tokens` (or its config's
    classifier_from_token); "generate" none."""
    if task not in TASKS:
        raise ValueError(f"task {task!r}: one of {', '.join(TASKS)}")
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json")
    if config.get("model_type") in ENCODER_TYPES:
        return _encoder_pooling(model_dir, config, task)
    classifier = any(name in CLASSIFIERS for name in config.get("architectures") or [])
    if classifier and task == "generate":
        raise ValueError(f"{model_dir} is a sequence-classification folder ({config['architectures'][0]}): it has "
                         "no LM head to generate with; serve it with task score (or auto)")
    if task == "generate":
        return None
    # EmbeddingGemma's flag, and the is_causal false of decoders trained to attend both ways
    for flag, bidirectional in (("use_bidirectional_attention", True), ("is_causal", False)):
        if config.get(flag, not bidirectional) == bidirectional:
            raise ValueError(f"{flag} {str(bidirectional).lower()} in {model_dir / 'config.json'}: bidirectional "
                             "attention is not supported (kvgate's engine attends causally)")
    if task == "score" or (classifier and task == "auto"):
        return _scoring(model_dir, config, classifier, tuple(score_tokens))
    if (model_dir / "modules.json").is_file():
        pooling = _sentence_transformers(model_dir)
    elif task == "embed" or any(name in BASE_MODELS for name in config.get("architectures") or []):
        pooling = LAST_NORMALIZED
    else:
        return None
    return replace(pooling, dimensions=_matryoshka(config))


def _scoring(model_dir: Path, config: dict, classifier: bool, score_tokens: tuple[str, ...]) -> Pooling:
    """A reranker's pooling: its last token's state, scored by its `score` head (one label) or by the
    LM head's rows for its answer tokens (one or two: "no", "yes")."""
    tokens = score_tokens or tuple(config.get("classifier_from_token") or ())
    if classifier and not score_tokens:
        _check_one_label(model_dir, config)
        return Pooling("last", False, score_tokens=())
    if not 1 <= len(tokens) <= 2:
        raise ValueError(f"task score on {model_dir} ({(config.get('architectures') or ['?'])[0]}) needs its "
                         f"answer tokens: --score-tokens with one or two tokens (Qwen3-Reranker: no,yes), or "
                         f"classifier_from_token in config.json; got {list(tokens)}")
    changed = [key for key, plain in LOGIT_CHANGES.items() if config.get(key, plain) not in (plain, None)]
    if changed:
        raise ValueError(f"{model_dir / 'config.json'} sets {changed[0]} {config[changed[0]]}: its logits are not "
                         "the LM head's rows as they stand, so answer tokens cannot score it")
    return Pooling("last", False, score_tokens=tokens)


def is_encoder_folder(model_dir: str | Path) -> bool:
    """A BERT-style encoder's folder (served by worker/engine/encoder.py, not the paged engine)."""
    return _read_json(Path(model_dir) / "config.json").get("model_type") in ENCODER_TYPES


def _check_one_label(model_dir: Path, config: dict) -> None:
    labels = config.get("num_labels", len(config.get("id2label") or {}) or 2)
    if labels != 1:
        raise ValueError(f"{model_dir / 'config.json'} has {labels} labels: a reranker has one (its score); "
                         "classification into several labels is not served")


def _encoder_pooling(model_dir: Path, config: dict, task: str) -> Pooling:
    """A BERT-style encoder's (worker/engine/encoder.py): a cross-encoder's classifier scores pairs
    (one label); otherwise it embeds, by its sentence-transformers files, or by its CLS token,
    normalized (vLLM's default for BERT folders without them)."""
    name = (config.get("architectures") or [config["model_type"]])[0]
    if task == "generate":
        raise ValueError(f"{model_dir} is an encoder ({name}): it embeds or scores pairs; it does not generate")
    classifier = name.endswith("ForSequenceClassification")
    if classifier and task in ("auto", "score"):
        _check_one_label(model_dir, config)
        return Pooling("cls", False, score_tokens=())
    if task == "score":
        raise ValueError(f"{model_dir} is an encoder without a classification head ({name}): it cannot score pairs "
                         "(a cross-encoder's <X>ForSequenceClassification folder can)")
    pooling = (_sentence_transformers(model_dir, encoder=True) if (model_dir / "modules.json").is_file()
               else Pooling("cls", True))
    return replace(pooling, dimensions=_matryoshka(config))


def score_head(model_dir: str | Path, pooling: Pooling, tokenizer, hidden_size: int):
    """A reranker's (w [hidden] float32, b float): its `score` head's row (and bias), or the LM head's
    row for the one answer token, or for "yes" less the row for "no" (P(yes) of the two =
    sigmoid(logit_yes - logit_no)); read from the checkpoint, whatever the worker shards."""
    import torch

    from worker.models.loader import _fallback, _open, weight_files

    files = weight_files(model_dir)
    if not pooling.score_tokens:
        if "score.weight" not in files:
            raise ValueError(f"{model_dir} is a sequence-classification folder without score.weight")
        weight = _open(files["score.weight"]).get_tensor("score.weight").float()
        if tuple(weight.shape) != (1, hidden_size):
            raise ValueError(f"score.weight in {model_dir} has shape {tuple(weight.shape)}; a reranker's is "
                             f"(1, {hidden_size})")
        bias = _open(files["score.bias"]).get_tensor("score.bias").float() if "score.bias" in files else None
        return weight[0], 0.0 if bias is None else float(bias[0])
    ids = []
    for token in pooling.score_tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
            raise ValueError(f"score token {token!r} is not one token of {model_dir}'s tokenizer")
        ids.append(token_id)
    name = _fallback("lm_head.weight", set(files))  # a tied checkpoint's embeddings
    if name not in files:
        raise ValueError(f"{model_dir} has no LM head (lm_head.weight) to score with")
    head = _open(files[name]).get_slice(name)
    rows = [head[i:i + 1].float()[0] for i in ids]
    if rows[0].dtype != torch.float32 or rows[0].shape != (hidden_size,):
        raise ValueError(f"{name} in {model_dir} is not a ({hidden_size},)-wide float head")
    return (rows[0] if len(rows) == 1 else rows[1] - rows[0]), 0.0


TEMPLATES = Path(__file__).resolve().parent.parent / "score_templates"  # bundled ones, by name


def read_score_template(name_or_path: str) -> str:
    """A score template's text: a file, or a bundled template's name (qwen3_reranker)."""
    path = Path(name_or_path)
    if not path.is_file() and (TEMPLATES / f"{name_or_path}.jinja").is_file():
        path = TEMPLATES / f"{name_or_path}.jinja"
    try:
        return path.read_text()
    except OSError as e:
        bundled = ", ".join(sorted(p.stem for p in TEMPLATES.glob("*.jinja")))
        raise ValueError(f"score template {name_or_path!r}: not a readable file nor a bundled template "
                         f"({bundled}): {e}") from e


def _sentence_transformers(model_dir: Path, encoder: bool = False) -> Pooling:
    """The Transformer's states pooled as the Pooling module's config says, normalized where a
    Normalize module follows (an encoder's may pool its CLS token: a decoder's first token sees
    nothing after it)."""
    modules = _read_json(model_dir / "modules.json")
    types = [module.get("type", "").rpartition(".")[2] for module in modules]
    if types not in MODULES:
        raise ValueError(f"{model_dir / 'modules.json'} lists modules {types}: supported are Transformer, Pooling "
                         "and optionally Normalize, in that order")
    file = model_dir / modules[1]["path"] / "config.json"
    config = _read_json(file)
    chosen = [key for key, on in config.items() if key.startswith("pooling_mode_") and on]
    modes = {**MODES, "pooling_mode_cls_token": "cls"} if encoder else MODES
    if len(chosen) != 1 or chosen[0] not in modes:
        raise ValueError(f"{file} pools by {chosen or 'no mode'}: supported is exactly one of {', '.join(modes)}")
    if not config.get("include_prompt", True):  # the instruction's tokens left out of the mean
        raise ValueError(f"{file} says include_prompt false: supported is pooling over every prompt token "
                         "(include_prompt true)")
    return Pooling(modes[chosen[0]], normalize=types == MODULES[1])


def _matryoshka(config: dict) -> tuple[int, ...] | None:
    if config.get("matryoshka_dimensions") is not None:
        return tuple(config["matryoshka_dimensions"])
    return () if config.get("is_matryoshka") else None


def _read_json(file: Path):
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{file} is missing or unreadable: {e}") from e
