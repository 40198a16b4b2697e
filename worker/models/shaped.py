"""Random-weight folders in the exact shape of a real model (Qwen3-0.6B), as a user downloads it:
bf16 safetensors in several shards with an index, tied embeddings, a long context, and a byte-level
BPE tokenizer padded to the real vocabulary size, with a chat template. Nothing is downloaded.

What a real folder stresses and the tiny test models do not: a 151,936-token vocabulary (sampling,
logprobs, the embedding), 28 layers of bf16 weights converted on load, sharded checkpoints, a
40,960-token context the KV cache must be sized for. Shards are written straight from random
tensors (no transformers model is built), so a build takes seconds, not a minute.
"""
from __future__ import annotations

import json
from pathlib import Path

from worker.engine.kv_budget import cdiv

QWEN3_0_6B = dict(arch="qwen3", vocab_size=151_936, hidden_size=1024, num_layers=28, num_heads=16,
                  num_kv_heads=8, head_dim=128, intermediate_size=3072, tie_word_embeddings=True,
                  max_position_embeddings=40_960, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
SPECIALS_AT = 151_643  # Qwen's <|endoftext|>, <|im_start|>, <|im_end|> ids
# Qwen's ids of the tool-call and thinking markers
MARKER_IDS = {"<tool_call>": 151_657, "</tool_call>": 151_658, "<think>": 151_667, "</think>": 151_668}
# transformers' 0.02 everywhere makes a tied model echo its input (the layers add little to the
# embedding the logits are read against); larger layer weights give varied greedy outputs
EMBED_STD, LAYER_STD = 0.02, 0.06
_FILLER_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def build_qwen3_06b_dir(path: str | Path, seed: int = 0, num_shards: int = 4) -> Path:
    """A Qwen3-0.6B-shaped folder at `path` (~1.2 GB); deterministic for a seed."""
    return build_shaped_dir(path, QWEN3_0_6B, seed, num_shards)


def build_shaped_dir(path: str | Path, shape: dict, seed: int = 0, num_shards: int = 4) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = padded_tokenizer(shape["vocab_size"])
    _write_config(path, shape, tokenizer)
    _write_shards(path, _tensor_shapes(shape), seed, num_shards)
    tokenizer.save_pretrained(path)
    return path


def padded_tokenizer(vocab_size: int):
    """The demo's byte-level BPE (worker/models/demo.py), its ids laid out as Qwen's: ordinary
    tokens from 0, filler tokens up to SPECIALS_AT, the special tokens there, fillers to the end but
    for the tool and thinking markers at Qwen's ids.
    Fillers are short ASCII words no merge produces, so they decode to readable text but encoding
    never yields them, as with a real tokenizer's rarely used tokens."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from worker.models.demo import MARKERS, SPECIAL_TOKENS, chat_template, train_tokenizer

    trained = json.loads(train_tokenizer().backend_tokenizer.to_str())
    old = trained["model"]["vocab"]
    ordinary = sorted((t for t in old if t not in SPECIAL_TOKENS and t not in MARKERS), key=old.get)
    vocab = {t: i for i, t in enumerate(ordinary)}
    placed = {SPECIALS_AT + i: t for i, t in enumerate(SPECIAL_TOKENS)} | {i: t for t, i in MARKER_IDS.items()}
    fillers = (w for w in map(_filler, range(vocab_size * 2)) if w not in old)
    while len(vocab) < vocab_size:
        vocab[placed.get(len(vocab)) or next(fillers)] = len(vocab)
    trained["model"]["vocab"] = vocab
    for added in trained["added_tokens"]:
        added["id"] = vocab[added["content"]]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(trained)), bos_token="<|endoftext|>",
        eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = chat_template()
    return fast


def _filler(i: int) -> str:
    """' ' (byte-level 'Ġ') + a 3-letter word: 238,328 distinct ones."""
    n = len(_FILLER_CHARS)
    return "Ġ" + "".join(_FILLER_CHARS[i // n ** k % n] for k in (2, 1, 0))


def _write_config(path: Path, shape: dict, tokenizer) -> None:
    import transformers

    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    config = transformers.Qwen3Config(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
        head_dim=shape["head_dim"], max_position_embeddings=shape["max_position_embeddings"],
        rope_theta=shape["rope_theta"], rms_norm_eps=shape["rms_norm_eps"],
        tie_word_embeddings=shape["tie_word_embeddings"], bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos[0], pad_token_id=tokenizer.pad_token_id, dtype="bfloat16")
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(path)
    generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos,
                  "pad_token_id": tokenizer.pad_token_id}
    (path / "generation_config.json").write_text(json.dumps(generation))


def _tensor_shapes(s: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape, in Hugging Face's Qwen3 naming (no lm_head: tied)."""
    h, q, kv, ffn = s["hidden_size"], s["num_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"], \
        s["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (s["vocab_size"], h)}
    for i in range(s["num_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "self_attn.q_norm.weight": (s["head_dim"],),
                   p + "self_attn.k_norm.weight": (s["head_dim"],),
                   p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                   p + "mlp.down_proj.weight": (h, ffn)}
    shapes["model.norm.weight"] = (h,)
    if not s["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (s["vocab_size"], h)
    return shapes


def _write_shards(path: Path, shapes: dict[str, tuple[int, ...]], seed: int, num_shards: int) -> None:
    """Matrices ~ N(0, EMBED_STD or LAYER_STD), norms 1, in bf16; cut into shards of about equal
    size, with the index a sharded download has."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    sizes = {name: 2 * _numel(shape) for name, shape in shapes.items()}
    per_shard = cdiv(sum(sizes.values()), num_shards)
    groups: list[list[str]] = [[]]
    filled = 0
    for name in shapes:
        if filled >= per_shard * len(groups) and len(groups) < num_shards:
            groups.append([])
        groups[-1].append(name)
        filled += sizes[name]
    weight_map = {}
    for k, names in enumerate(groups, 1):
        file = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: _random(n, shapes[n], gen) for n in names}
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, file)
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _random(name: str, shape: tuple[int, ...], gen):
    import torch

    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    std = EMBED_STD if "embed" in name or "lm_head" in name else LAYER_STD
    return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, std, generator=gen)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
