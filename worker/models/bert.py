"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa: all-MiniLM, bge, e5, bge-reranker, ms-marco
cross-encoders) for /v1/embeddings and /v1/rerank: the whole input in one pass, every token attending
to every real token of its row (no cache, no causal mask), and a sequence-classification head that
scores position 0 for cross-encoder rerankers. Computes what transformers' BertModel /
XLMRobertaModel return as `last_hidden_state`, and their ForSequenceClassification logits; a config
asking for anything else is refused by the field that asks."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.loader import _open, weight_files

ENCODER_TYPES = ("bert", "roberta", "xlm-roberta")  # config.json's model_type
_ARCH_PREFIX = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta"}
# a MaskedLM folder is served as its base model: the `cls.` / `lm_head.` tensors are never read
_ARCH_SUFFIXES = ("Model", "ForSequenceClassification", "ForMaskedLM")


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' NewGELUActivation, written out as it writes it (gelu_pytorch_tanh's fused kernel
    rounds differently)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


# hidden_act -> what transformers' ACT2FN computes for it
ACTIVATIONS = {"gelu": F.gelu, "gelu_new": _gelu_new, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
               "relu": F.relu}


def is_encoder(config: dict) -> bool:
    """A config.json (as a dict) of a family this module computes."""
    return config.get("model_type") in ENCODER_TYPES


@dataclass(frozen=True)
class EncoderConfig:
    model_type: str  # one of ENCODER_TYPES; "bert" counts positions from 0, the RoBERTas past pad_token_id
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    hidden_act: str  # a key of ACTIVATIONS
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    pad_token_id: int
    num_labels: int | None  # None: no classification head
    classifier: str | None  # None, "bert" (pooler, then `classifier`), "roberta" (`classifier.dense`, `.out_proj`)
    dtype: str | None = None  # as the checkpoint was saved

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_tokens(self) -> int:
        """The longest input, special tokens counted: a RoBERTa's first position is pad_token_id + 1."""
        offset = 0 if self.model_type == "bert" else self.pad_token_id + 1
        return self.max_position_embeddings - offset


def read_encoder_config(model_dir: str | Path) -> EncoderConfig:
    """The folder's config.json, refused (ValueError naming the field) where it asks for what Encoder
    does not compute."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    model_type = raw.get("model_type")
    if model_type not in ENCODER_TYPES:
        raise ValueError(f"model_type {model_type!r}: the encoder path serves {', '.join(ENCODER_TYPES)}")
    _refuse_what_differs(raw, model_type)
    architectures = raw.get("architectures") or [f"{_ARCH_PREFIX[model_type]}Model"]
    classifies = any(name.endswith("ForSequenceClassification") for name in architectures)
    if raw["hidden_size"] % raw["num_attention_heads"]:
        raise ValueError(f"hidden_size {raw['hidden_size']} is not a multiple of num_attention_heads "
                         f"{raw['num_attention_heads']}")
    return EncoderConfig(
        model_type=model_type, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"], num_heads=raw["num_attention_heads"],
        intermediate_size=raw["intermediate_size"], hidden_act=raw.get("hidden_act", "gelu"),
        max_position_embeddings=raw.get("max_position_embeddings", 512),
        type_vocab_size=raw.get("type_vocab_size", 2), layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
        pad_token_id=raw.get("pad_token_id", 0 if model_type == "bert" else 1),
        # transformers counts id2label where there is one (num_labels itself is not saved), else 2
        num_labels=(len(raw["id2label"]) if raw.get("id2label") else raw.get("num_labels", 2)) if classifies else None,
        classifier=("bert" if model_type == "bert" else "roberta") if classifies else None,
        dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )


def _refuse_what_differs(raw: dict, model_type: str) -> None:
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type {raw['position_embedding_type']!r}: only \"absolute\" is computed")
    if raw.get("is_decoder"):
        raise ValueError("is_decoder true: a causal BERT is not an encoder")
    if raw.get("add_cross_attention"):
        raise ValueError("add_cross_attention true: an encoder-decoder's half is not served")
    if raw.get("hidden_act", "gelu") not in ACTIVATIONS:
        raise ValueError(f"hidden_act {raw['hidden_act']!r}: one of {', '.join(ACTIVATIONS)}")
    allowed = [_ARCH_PREFIX[model_type] + suffix for suffix in _ARCH_SUFFIXES]
    if any(name not in allowed for name in raw.get("architectures") or []):
        raise ValueError(f"architectures {raw['architectures']}: a {model_type} folder served here is one of "
                         f"{', '.join(allowed)}")


class _Embeddings(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids, attention_mask, token_type_ids):
        position_ids = self.position_ids(attention_mask)
        embeddings = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(embeddings + self.position_embeddings(position_ids))

    def position_ids(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """BERT: 0, 1, 2, ... RoBERTa: pad_token_id + 1 + the count of real tokens before, padding at
        pad_token_id (transformers' create_position_ids_from_input_ids, read off the mask)."""
        if self.cfg.model_type == "bert":
            return torch.arange(attention_mask.shape[1], device=attention_mask.device).expand_as(attention_mask)
        real = attention_mask.long()
        return real.cumsum(dim=1) * real + self.cfg.pad_token_id


class _SelfAttention(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.query, self.key, self.value = (nn.Linear(cfg.hidden_size, cfg.hidden_size) for _ in range(3))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = (proj(x).view(batch, length, self.num_heads, -1).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        # each query attends to every real key of its row, before and after it
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask[:, None, None, :])
        return out.transpose(1, 2).reshape(batch, length, hidden)


class _DenseNorm(nn.Module):
    """dense, then the residual added, then LayerNorm: each sublayer's output (post-norm)."""

    def __init__(self, cfg: EncoderConfig, inputs: int):
        super().__init__()
        self.dense = nn.Linear(inputs, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.self = _SelfAttention(cfg)  # transformers' name: the checkpoint's `attention.self.query`
        self.output = _DenseNorm(cfg, cfg.hidden_size)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, attention_mask), x)


class _Intermediate(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class _Layer(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.attention = _Attention(cfg)
        self.intermediate = _Intermediate(cfg)
        self.output = _DenseNorm(cfg, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, attention_mask)
        return self.output(self.intermediate(x), x)


class _RobertaHead(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first)))


class Encoder(nn.Module):
    """The encoder stack, its modules named as transformers names them (a checkpoint's tensor names
    less the `bert.` / `roberta.` prefix), and the classification head where cfg has one."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = _Embeddings(cfg)
        self.encoder = nn.ModuleDict({"layer": nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))})
        if cfg.classifier == "bert":
            self.pooler = nn.ModuleDict({"dense": nn.Linear(cfg.hidden_size, cfg.hidden_size)})
            self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)
        elif cfg.classifier == "roberta":
            self.classifier = _RobertaHead(cfg)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask (bool, True at real tokens), token_type_ids: [B, T] -> the final
        hidden states [B, T, H]. Rows at padding hold anything."""
        x = self.embeddings(input_ids, attention_mask, token_type_ids)
        for layer in self.encoder["layer"]:
            x = layer(x, attention_mask)
        return x

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, H] final hidden states -> [B, num_labels] logits, from position 0 (CLS / <s>)."""
        first = hidden[:, 0]
        if self.cfg.classifier == "bert":
            return self.classifier(torch.tanh(self.pooler["dense"](first)))
        if self.cfg.classifier == "roberta":
            return self.classifier(first)
        raise ValueError(f"this {self.cfg.model_type} folder has no sequence-classification head")


def load_encoder(model_dir: str | Path, device: torch.device | str, dtype: torch.dtype) -> Encoder:
    """Build on the meta device (no init cost), materialise on `device`, fill every parameter from the
    folder's checkpoint; a checkpoint's tensors no parameter asks for (a MaskedLM's head, a bare
    model's unused pooler) are never read."""
    cfg = read_encoder_config(model_dir)
    with torch.device("meta"):
        model = Encoder(cfg).to(dtype)
    model.to_empty(device=device)
    files = weight_files(model_dir)
    handles = {file: _open(file) for file in set(files.values())}
    missing = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            stored = _stored_name(name, files)
            if stored is None:
                missing.append(name)
                continue
            tensor = handles[files[stored]].get_tensor(stored)
            if tensor.shape != param.shape:
                raise ValueError(f"{stored} is {list(tensor.shape)} where the config's model holds {list(param.shape)}")
            param.copy_(tensor)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights for {missing[:5]}")
    return model.eval()


def _stored_name(name: str, names) -> str | None:
    """`name` as the checkpoint spells it: bare (a base model's), under `bert.` / `roberta.` (a
    classifier's or MaskedLM's encoder), and LayerNorm's as `gamma` / `beta` (TF-era BERT checkpoints)."""
    tf_era = name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
    for spelled in (name, tf_era):
        for prefix in ("", "bert.", "roberta."):
            if prefix + spelled in names:
                return prefix + spelled
    return None
