"""Tokenizer loading, EOS discovery and chat rendering from a local Hugging Face folder."""
from __future__ import annotations

import json
from pathlib import Path

from worker.engine.types import EngineRejected


def load_tokenizer(model_dir: str | Path):
    """The folder's own tokenizer; local files only, so a worker never reaches the network. A
    multimodal folder (Gemma 3 4B and up) may keep its chat template only in chat_template.json,
    the processor's file, which AutoTokenizer does not read: the template is taken from there."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, **_config_for(model_dir))
    if getattr(tokenizer, "chat_template", None) is None:
        template = _json(model_dir / "chat_template.json").get("chat_template")
        if isinstance(template, str):
            tokenizer.chat_template = template
    return tokenizer


def _config_for(model_dir: Path) -> dict:
    """AutoTokenizer reads the folder's model config only to check the class tokenizer_config.json
    names (by the config's model_type, name and tokenizer_class); loading it imports the model's
    configuration module, which in transformers 5 pulls in torch.distributed.tensor and sympy:
    ~0.7 s of every worker's start. Where tokenizer_config.json names its class and brings no code
    of its own, AutoTokenizer gets a plain config carrying just what it reads, so it picks the
    class it would have picked; otherwise ({}) it loads the folder's config itself."""
    tokenizer_config = _json(model_dir / "tokenizer_config.json")
    config = _json(model_dir / "config.json")
    if (not tokenizer_config.get("tokenizer_class") or "auto_map" in tokenizer_config
            or not isinstance(config.get("model_type"), str) or "auto_map" in config):
        return {}
    from transformers import PretrainedConfig

    plain = PretrainedConfig(name_or_path=str(model_dir), tokenizer_class=config.get("tokenizer_class"))
    plain.model_type = config["model_type"]
    if "model_name" in config:
        plain.model_name = config["model_name"]
    return {"config": plain}


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _ids(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def eos_token_ids(model_dir: str | Path, tokenizer) -> set[int]:
    """Every id that ends a turn: models often list extra EOS ids only in config or generation_config."""
    model_dir = Path(model_dir)
    ids = _ids(getattr(tokenizer, "eos_token_id", None))
    ids |= _ids(_json(model_dir / "config.json").get("eos_token_id"))
    ids |= _ids(_json(model_dir / "generation_config.json").get("eos_token_id"))
    return ids


# apply_chat_template's own arguments: a request's chat_template_kwargs never override ours
RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "return_dict", "return_tensors", "return_assistant_tokens_mask", "chat_template",
    "padding", "truncation", "max_length", "tokenizer_kwargs"})


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False, add_special_tokens: bool = False) -> list[int]:
    """Token ids of `messages` in the folder's chat template, ending where the assistant speaks
    (or, for /tokenize, as its options say); `tools` and `chat_template_kwargs` (e.g.
    enable_thinking) are the template's to use.

    A real model's template refuses messages it does not like by raising (jinja2's TemplateError
    through its `raise_exception`, or a TypeError on an odd shape): that is the request's fault,
    so it is refused as an invalid request, not counted as an engine failure."""
    if not getattr(tokenizer, "chat_template", None):
        raise EngineRejected("this model folder has no chat template; use a completion prompt instead",
                             "invalid_request", "messages")
    extra = {k: v for k, v in (chat_template_kwargs or {}).items() if k not in RESERVED_KWARGS}
    messages = [_template_message(m, i) for i, m in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **extra)
    except Exception as exc:  # the template is fixed, so whatever it raises, the messages caused
        raise EngineRejected(f"the model's chat template refused these messages: "
                             f"{str(exc) or type(exc).__name__}", "invalid_request", "messages") from exc
    try:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))  # the template placed BOS
    except (TypeError, UnicodeError) as exc:  # text UTF-8 cannot hold (a lone surrogate the gateway let by)
        raise EngineRejected(f"the rendered messages cannot be encoded: {exc}", "invalid_request",
                             "messages") from exc


def encode_pair(tokenizer, query: str, document: str, template: str | None = None) -> list[int]:
    """A reranker's input for (query, document): rendered by its score template (vLLM's: a chat
    template over messages of roles "query" and "document", which places the special tokens), or,
    without one, the tokenizer's own pair encoding (as vLLM's cross-encoding: `tokenizer(q, d)`).
    A template that refuses the texts, or texts UTF-8 cannot hold, refuse the request."""
    try:
        if template is None:
            return list(tokenizer(query, document)["input_ids"])
        messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    except Exception as exc:  # the template and tokenizer are fixed: the texts caused it
        raise EngineRejected(f"this (query, document) pair cannot be rendered: {str(exc) or type(exc).__name__}",
                             "invalid_request") from exc


def _template_message(message: dict, position: int) -> dict:
    """An assistant message's tool calls with their arguments as a mapping, as templates (Qwen's,
    Llama's) expect and vLLM passes them; OpenAI sends them as a JSON string."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not isinstance(calls, list):
        return message
    return {**message, "tool_calls": [_parsed_call(c, position, i) for i, c in enumerate(calls)]}


def _parsed_call(call, position: int, index: int):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past Python's limit
        raise EngineRejected(f"messages[{position}].tool_calls[{index}].function.arguments is not JSON: "
                             f"{str(exc) or type(exc).__name__}", "invalid_request", "messages") from exc
    return {**call, "function": {**function, "arguments": arguments}}


def marker_ids(tokenizer, markers: tuple[str, ...]) -> list[int] | None:
    """The id of each marker when every one is a single token of this tokenizer, else None."""
    ids = [tokenizer.encode(m, add_special_tokens=False) for m in markers]
    return [i[0] for i in ids] if all(len(i) == 1 for i in ids) else None


def encode_prompt(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Ids of a completion prompt, with the tokenizer's own BOS handling (as vLLM does)."""
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def decode_ids(tokenizer, ids: list[int], max_len: int) -> str:
    """/detokenize's text: every id as it is, special tokens included (as vLLM's); at most a
    context's worth, and an id the tokenizer does not know is refused by name, not decoded as
    nothing (the gateway checks both first; this is for entries that did not come through it)."""
    if len(ids) > max_len:
        raise EngineRejected(f"{len(ids)} tokens to detokenize; at most the model's context, "
                             f"{max_len}", "invalid_request", "tokens")
    known = len(tokenizer)
    for position, token in enumerate(ids):
        if not 0 <= token < known:
            raise EngineRejected(f"token id {token} at position {position} is outside this model's "
                                 f"tokenizer [0, {known})", "invalid_request", "tokens")
    return tokenizer.decode(ids)
