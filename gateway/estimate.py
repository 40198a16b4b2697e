"""Tokens a request is charged at admission, before the worker has tokenized anything."""
from __future__ import annotations

CHARS_PER_TOKEN = 4  # a rough, tokenizer-free rate for English text
MESSAGE_OVERHEAD = 4  # role and separator tokens a chat template adds per message


def prompt_tokens(prompt: dict) -> int:
    """Exact for token-id prompts; otherwise characters / 4, plus the chat template's overhead."""
    if prompt.get("prompt_token_ids") is not None:
        return len(prompt["prompt_token_ids"])
    if prompt.get("messages") is not None:
        return sum(_text(m["content"]) + MESSAGE_OVERHEAD for m in prompt["messages"])
    return _text(prompt.get("prompt") or "")


def request_tokens(prompt: dict, max_tokens: int | None, n: int) -> int:
    """The reservation: the prompt once plus every completion's cap (none: the prompt alone)."""
    return prompt_tokens(prompt) + (max_tokens or 0) * n


def _text(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN) + 1
