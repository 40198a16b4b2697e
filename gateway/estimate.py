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


def completion_tokens(prompt: int, max_tokens: int | None, max_model_len: int | None,
                      default: int) -> int:
    """One completion's share of the reservation: its cap; without one, `default` tokens, or what
    the context leaves after the prompt when that is less. Reserving the whole rest of the context
    would refuse every such request on a long-context model; the prompt alone would let the
    completion run past the limit by up to the whole context. The settlement makes it exact."""
    if max_tokens is not None:
        return max_tokens
    if max_model_len is None:
        return default
    return min(default, max(1, max_model_len - prompt))


def request_tokens(prompt: dict, max_tokens: int | None, n: int, max_model_len: int | None = None,
                   default_completion: int = 0) -> int:
    """The reservation: each prompt once plus every completion's share (n of them a prompt)."""
    total = 0
    for one in each_prompt(prompt):
        tokens = prompt_tokens(one)
        total += tokens + completion_tokens(tokens, max_tokens, max_model_len, default_completion) * n
    return total


def each_prompt(prompt: dict) -> list[dict]:
    """The prompts of an entry's prompt fields, each as a prompt of its own: a batched completion's
    (`prompts`: texts or id lists), else the one."""
    if prompt.get("prompts") is None:
        return [prompt]
    return [{"prompt_token_ids": p} if isinstance(p, list) else {"prompt": p} for p in prompt["prompts"]]


def _text(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN) + 1
