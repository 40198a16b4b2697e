"""What a valid key may still not ask for: a model it is not allowed, more tokens than the context."""
from __future__ import annotations

from gateway.keys import KeyRecord
from shared.errors import ContextLengthExceeded, PermissionDenied


def check_model_allowed(key: KeyRecord, model: str) -> None:
    if not key.allows(model):
        raise PermissionDenied(f"This API key may not use the model '{model}'", param="model")


def check_context(max_model_len: int | None, max_tokens: int | None, prompt: dict) -> None:
    """400 with the numbers when max_tokens (plus a token-id prompt, whose length is known) does
    not fit the context; text prompts are measured exactly by the worker, which refuses likewise."""
    if max_model_len is None or max_tokens is None:
        return
    if max_tokens > max_model_len:
        raise ContextLengthExceeded(
            f"max_tokens is {max_tokens}, but this model's maximum context length is "
            f"{max_model_len} tokens", param="max_tokens")
    ids = prompt.get("prompt_token_ids")
    if ids is not None and len(ids) + max_tokens > max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens, but you requested "
            f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
            f"completion)", param="max_tokens")
