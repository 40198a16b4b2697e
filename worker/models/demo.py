"""Small random-weight models with a real byte-level BPE tokenizer, written as ordinary HF folders.

Used by `kvgate demo-model` (the default model of `make run`) and by tests, which then load the
folder through the same code path as a downloaded model. Nothing is downloaded.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

# Qwen-style (Qwen2.5/Qwen3): tools listed in the system turn, calls written as <tool_call>{json}</tool_call>,
# results sent back in a user turn as <tool_response>, and thinking opened by `enable_thinking`. A chat
# without tools or thinking renders exactly as the plain ChatML template before it did.
CHAT_TEMPLATE = """\
{%- if enable_thinking is not defined %}{%- set enable_thinking = THINKING_DEFAULT %}{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{{- '\n\n' }}{%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments '
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n'
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'system' and loop.first and tools %}
    {%- elif message['role'] == 'assistant' and message['tool_calls'] %}
        {{- '<|im_start|>assistant' }}
        {%- if message['content'] %}{{- '\n' }}{{- message['content'] }}{%- endif %}
        {%- for call in message['tool_calls'] %}
            {%- if call['function'] is defined %}{%- set call = call['function'] %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}{{- call['name'] }}{{- '", "arguments": ' }}
            {{- call['arguments'] | tojson }}{{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message['role'] == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' }}{{- message['content'] }}{{- '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- else %}
        {{- '<|im_start|>' }}{{- message['role'] }}{{- '\n' }}{{- message['content'] }}{{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking %}{{- '<think>\n' }}{%- endif %}
{%- endif %}
"""


def chat_template(thinking_default: bool = False) -> str:
    """The template, thinking when a request does not say (`enable_thinking`) as `thinking_default`."""
    return CHAT_TEMPLATE.replace("THINKING_DEFAULT", "true" if thinking_default else "false")


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# One token each, and kept in decoded text (not special), as in Qwen's tokenizer: the gateway's tool
# parser reads <tool_call> in the text, the worker strips the thinking markers from it.
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

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


def train_tokenizer(vocab_size: int = 2048, seed: int = 0, thinking: bool = False):
    """A byte-level BPE tokenizer trained offline on a fixed synthetic corpus; deterministic. The
    markers take the last ids, so the vocabulary is still `vocab_size`; `thinking`: the template
    thinks unless a request says `enable_thinking: false`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKERS), special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token=None,
    )
    fast.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    fast.chat_template = chat_template(thinking)
    return fast


def _config(arch: str, **kw):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "phi3": transformers.Phi3Config, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config, "gemma2": transformers.Gemma2Config,
           "gemma3": transformers.Gemma3TextConfig, "granite": transformers.GraniteConfig,
           "mixtral": transformers.MixtralConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
           "qwen3_moe": transformers.Qwen3MoeConfig, "olmo2": transformers.Olmo2Config,
           "olmo3": transformers.Olmo3Config, "olmoe": transformers.OlmoeConfig,
           "smollm3": transformers.SmolLM3Config, "ministral3": transformers.Ministral3Config,
           "gpt_oss": transformers.GptOssConfig, "gemma": transformers.GemmaConfig,
           "glm": transformers.GlmConfig, "glm4": transformers.Glm4Config, "olmo": transformers.OlmoConfig,
           "cohere": transformers.CohereConfig, "cohere2": transformers.Cohere2Config,
           "glm4_moe": transformers.Glm4MoeConfig, "granitemoe": transformers.GraniteMoeConfig,
           "granitemoeshared": transformers.GraniteMoeSharedConfig, "phimoe": transformers.PhimoeConfig,
           "ernie4_5": transformers.Ernie4_5Config, "deepseek_v2": transformers.DeepseekV2Config,
           "deepseek_v3": transformers.DeepseekV3Config, "exaone4": transformers.Exaone4Config,
           "seed_oss": transformers.SeedOssConfig, "arcee": transformers.ArceeConfig,
           "starcoder2": transformers.Starcoder2Config, "stablelm": transformers.StableLmConfig,
           "hunyuan_v1_dense": transformers.HunYuanDenseV1Config, "apertus": transformers.ApertusConfig,
           "llama4": transformers.Llama4TextConfig}[arch]
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
    thinking: bool = False,
    config_extra: dict | None = None,
) -> Path:
    """Write a deterministic random-weight `arch` model plus tokenizer to `path` and return it;
    `thinking`: its chat template opens <think> unless a request sets `enable_thinking: false`;
    `config_extra`: more of the config class's fields (a Mistral's `sliding_window`, ...)."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size=vocab_size, seed=seed, thinking=thinking)
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
    kw.update(config_extra or {})
    config = _config(arch, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default init so greedy outputs vary across prompts
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # Cohere's per-head q/k norms: around 1, as built, but each head its own
                p.normal_(1.0, 0.3) if "_norm." in name else p.normal_(0.0, 0.08)
        for name, b in model.named_buffers():  # GLM-4.5's, DeepSeek-V3's router bias, built as zeros: drawn
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    return path


POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")


def build_embedding_dir(path: str | Path, *, arch: str = "qwen3", pooling: str | None = "lasttoken",
                        normalize: bool = True, bare: bool = True, matryoshka: bool | list[int] | None = None,
                        **kw) -> Path:
    """An embedding model's folder: build_model_dir's model, saved as its bare base model where `bare`
    (architectures ["Qwen3Model"], tensors without "model.", no lm_head: e5-mistral's layout), with
    sentence-transformers' files unless `pooling` is None (pooling_mode_<pooling>, one of
    POOLING_MODES, then Normalize where `normalize`: Qwen3-Embedding's); `matryoshka` True or the
    lengths a vector may be cut to, in config.json as is_matryoshka or matryoshka_dimensions."""
    import torch
    import transformers

    if pooling is not None and pooling not in POOLING_MODES:
        raise ValueError(f"pooling {pooling!r}: one of {', '.join(POOLING_MODES)}")
    path = build_model_dir(path, arch=arch, **kw)
    if bare:
        base = transformers.AutoModel.from_pretrained(path, dtype=torch.float32)
        for stale in [*path.glob("*.safetensors"), *path.glob("*.safetensors.index.json")]:
            stale.unlink()
        base.save_pretrained(path, safe_serialization=True)
    config = json.loads((path / "config.json").read_text())
    if matryoshka is not None:
        config["is_matryoshka" if matryoshka is True else "matryoshka_dimensions"] = matryoshka
        (path / "config.json").write_text(json.dumps(config, indent=2))
    if pooling is not None:
        _write_sentence_transformers(path, config["hidden_size"], pooling, normalize)
    return path


def _write_sentence_transformers(path: Path, hidden_size: int, pooling: str, normalize: bool) -> None:
    """modules.json, 1_Pooling/config.json (pooling_mode_<pooling>) and 2_Normalize where `normalize`."""
    modules = ["Transformer", "Pooling"] + (["Normalize"] if normalize else [])
    folders = ["", "1_Pooling", "2_Normalize"]
    (path / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": folder, "type": f"sentence_transformers.models.{kind}"}
        for i, (kind, folder) in enumerate(zip(modules, folders))], indent=2))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden_size,
        **{f"pooling_mode_{mode}": mode == pooling for mode in POOLING_MODES}, "include_prompt": True}, indent=2))
    if normalize:
        (path / "2_Normalize").mkdir()


def build_reranker_dir(path: str | Path, *, arch: str = "qwen3", classifier: bool = True, **kw) -> Path:
    """A reranker's folder: build_model_dir's model, saved where `classifier` as its
    <X>ForSequenceClassification with one label and a random `score` head (Qwen3-Reranker-seq-cls'
    layout; pad_token_id set, which transformers' head needs to find the last token); otherwise the
    causal LM as it is, to be served with task score and answer tokens (the original Qwen3-Reranker's)."""
    import torch
    import transformers

    path = build_model_dir(path, arch=arch, **kw)
    if not classifier:
        return path
    config = transformers.AutoConfig.from_pretrained(path)
    config.num_labels, config.pad_token_id = 1, config.pad_token_id if config.pad_token_id is not None else 0
    causal = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    model.model.load_state_dict(causal.model.state_dict())
    torch.manual_seed(kw.get("seed", 0) + 1)
    torch.nn.init.normal_(model.score.weight, std=0.5)  # random, wide enough that scores spread
    for stale in [*path.glob("*.safetensors"), *path.glob("*.safetensors.index.json")]:
        stale.unlink()
    model.save_pretrained(path, safe_serialization=True)
    return path


ENCODER_KINDS = ("bert", "xlm-roberta")
ENCODER_SPECIALS = {"bert": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
                    "xlm-roberta": ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]}  # XLM-R's ids 0-4, as in its own


def train_encoder_tokenizer(kind: str = "bert", vocab_size: int = 1024, seed: int = 0):
    """bert: a lower-casing WordPiece tokenizer in BertTokenizerFast (a pair: [CLS] a [SEP] b [SEP], with
    token_type_ids); xlm-roberta: a Unigram (SentencePiece-style, "▁" for spaces) in
    XLMRobertaTokenizerFast (a pair: <s> a </s></s> b </s>). Trained offline on the synthetic corpus."""
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    if kind == "bert":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=ENCODER_SPECIALS[kind],
                                            show_progress=False)
        tok.train_from_iterator(_corpus(seed=seed), trainer=trainer)
        return transformers.BertTokenizerFast(vocab=tok.get_vocab())
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")])
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=ENCODER_SPECIALS[kind],
                                      unk_token="<unk>", show_progress=False)
    tok.train_from_iterator(_corpus(seed=seed), trainer=trainer)
    pieces = json.loads(tok.to_str())["model"]["vocab"]
    return transformers.XLMRobertaTokenizerFast(vocab=[(piece, score) for piece, score in pieces])


def build_encoder_dir(path: str | Path, *, kind: str = "bert", classifier: bool = False, num_labels: int = 1,
                      pooling: str | None = "cls", normalize: bool = True, hidden_size: int = 64,
                      num_layers: int = 2, num_heads: int = 4, intermediate_size: int = 128, seed: int = 0) -> Path:
    """A BERT-style encoder's folder: a random BertModel / XLMRobertaModel (all-MiniLM's, bge's layout),
    or where `classifier` its ForSequenceClassification with `num_labels` (ms-marco's, bge-reranker's),
    and train_encoder_tokenizer's tokenizer; an embedding model (not `classifier`) gets
    sentence-transformers' files unless `pooling` is None: pooling_mode_<pooling> ("cls" for
    cls_token, "mean" for mean_tokens, or one of POOLING_MODES), then Normalize where `normalize`."""
    import torch
    import transformers

    if kind not in ENCODER_KINDS:
        raise ValueError(f"kind {kind!r}: one of {', '.join(ENCODER_KINDS)}")
    mode = {"cls": "cls_token", "mean": "mean_tokens"}.get(pooling, pooling)
    if mode is not None and mode not in POOLING_MODES:
        raise ValueError(f"pooling {pooling!r}: cls, mean or one of {', '.join(POOLING_MODES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_encoder_tokenizer(kind, seed=seed)
    kw = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
              num_attention_heads=num_heads, intermediate_size=intermediate_size,
              pad_token_id=tokenizer.pad_token_id, dtype="float32")
    if kind == "bert":
        config = transformers.BertConfig(**kw, max_position_embeddings=512, type_vocab_size=2)
    else:  # XLM-R's: positions past pad_token_id (514 for 512 tokens), one token type
        config = transformers.XLMRobertaConfig(**kw, max_position_embeddings=514, type_vocab_size=1,
                                               layer_norm_eps=1e-5, bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id)
    if classifier:
        config.num_labels = num_labels
    torch.manual_seed(seed)
    auto = transformers.AutoModelForSequenceClassification if classifier else transformers.AutoModel
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # wider than the default init so that vectors and scores differ across inputs
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    if mode is not None and not classifier:
        _write_sentence_transformers(path, hidden_size, mode, normalize)
    return path
