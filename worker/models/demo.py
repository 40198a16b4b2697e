"""Small random-weight models with a real byte-level BPE tokenizer, written as ordinary HF folders.

Used by `kvgate demo-model` (the default model of `make run`) and by tests, which then load the
folder through the same code path as a downloaded model. Nothing is downloaded.
"""
from __future__ import annotations

import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_WORDS = (
    "the a of and to in is it you that he was for on are with as I his they be at one have this "
    "from or had by hot word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like so "
    "these her long make thing see him two has look more day could go come did number sound no "
    "most people my over know water than call first who may down side been now find any new work "
    "part take get place made live where after back little only round man year came show every "
    "good me give our under name very through just form sentence great think say help low line "
    "model token cache block stream worker gateway request latency throughput redis queue batch "
    "héllo naïve café über straße 你好 世界 日本語 😀 🚀 ünïcödé"
).split()


def _corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 16))]
        line = " ".join(words).capitalize() + rng.choice([".", "?", "!", ","])
        if rng.random() < 0.2:
            line += f" {rng.randint(0, 99999)}"
        lines.append(line)
    return lines


def train_tokenizer(vocab_size: int = 2048, seed: int = 0):
    """A byte-level BPE tokenizer trained offline on a fixed synthetic corpus; deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _config(arch: str, **kw):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}[arch]
    return cls(**kw)


def build_model_dir(
    path: str | Path,
    *,
    arch: str = "llama",
    vocab_size: int = 2048,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    intermediate_size: int = 688,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    rope_theta: float = 10000.0,
    seed: int = 0,
    head_dim: int | None = None,
) -> Path:
    """Write a deterministic random-weight `arch` model plus tokenizer to `path` and return it."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size=vocab_size, seed=seed)
    kw = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, rope_theta=rope_theta,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )
    if rope_scaling is not None:
        kw["rope_scaling"] = rope_scaling
    if head_dim is not None:
        kw["head_dim"] = head_dim
    config = _config(arch, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default init so greedy outputs vary across prompts
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    return path
