"""Tokenizer loading, EOS discovery and chat rendering from a local Hugging Face folder."""
from __future__ import annotations

import json
from pathlib import Path

from worker.engine.types import EngineRejected


def load_tokenizer(model_dir: str | Path):
    """The folder's own tokenizer; local files only, so a worker never reaches the network."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _ids(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _json_field(path: Path, key: str):
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get(key)


def eos_token_ids(model_dir: str | Path, tokenizer) -> set[int]:
    """Every id that ends a turn: models often list extra EOS ids only in config or generation_config."""
    model_dir = Path(model_dir)
    ids = _ids(getattr(tokenizer, "eos_token_id", None))
    ids |= _ids(_json_field(model_dir / "config.json", "eos_token_id"))
    ids |= _ids(_json_field(model_dir / "generation_config.json", "eos_token_id"))
    return ids


def render_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` in the folder's chat template, ending where the assistant speaks.

    A real model's template refuses messages it does not like by raising (jinja2's TemplateError
    through its `raise_exception`, or a TypeError on an odd shape): that is the request's fault,
    so it is refused as an invalid request, not counted as an engine failure."""
    if not getattr(tokenizer, "chat_template", None):
        raise EngineRejected("this model folder has no chat template; use a completion prompt instead",
                             "invalid_request", "messages")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # the template is fixed, so whatever it raises, the messages caused
        raise EngineRejected(f"the model's chat template refused these messages: "
                             f"{str(exc) or type(exc).__name__}", "invalid_request", "messages") from exc
    return list(tokenizer.encode(text, add_special_tokens=False))  # the template placed BOS itself


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Ids of a completion prompt, with the tokenizer's own BOS handling (as vLLM does)."""
    return list(tokenizer.encode(text, add_special_tokens=True))
