"""What a valid request may still not ask for: a model its key is not allowed, more tokens than the
context, token ids outside the model's vocabulary, a feature the workers of its stream do not
speak. The model's numbers come from the facts its workers register (gateway/registry.py); the
worker checks them again, for entries that did not come through this code (an older gateway, a
takeover)."""
from __future__ import annotations

from gateway.estimate import each_prompt
from gateway.keys import KeyRecord
from shared import protocol
from shared.errors import ContextLengthExceeded, InvalidRequest, Overloaded, PermissionDenied


def check_model_allowed(key: KeyRecord, model: str) -> None:
    if not key.allows(model):
        raise PermissionDenied(f"This API key may not use the model '{model}'", param="model")


def check_output_limits(min_tokens: int, limit: int | None) -> None:
    if limit is not None and min_tokens > limit:
        raise InvalidRequest(f"min_tokens ({min_tokens}) must not exceed max_tokens ({limit})",
                             param="min_tokens")


def check_token_ids(vocab_size: int | None, prompt: dict, stop_token_ids: list[int],
                    logit_bias: dict[int, float] | None = None) -> None:
    """400 naming the first id outside [0, vocab_size), before anything is queued."""
    if vocab_size is None:
        return
    prompts = [(f"prompt {i}" if "prompts" in prompt else "prompt", one.get("prompt_token_ids") or ())
               for i, one in enumerate(each_prompt(prompt))]
    for param, ids in (*prompts, ("stop_token_ids", stop_token_ids), ("logit_bias", list(logit_bias or ()))):
        if not ids or 0 <= min(ids) and max(ids) < vocab_size:  # in C: a prompt may be 2^20 ids
            continue
        for position, token in enumerate(ids):
            if not 0 <= token < vocab_size:
                raise InvalidRequest(
                    f"{param} token id {token} at position {position} is outside this model's "
                    f"vocabulary [0, {vocab_size})", param=param.partition(" ")[0], code="invalid_token_id")


def check_context(max_model_len: int | None, max_tokens: int | None, prompt: dict) -> None:
    """400 with the numbers when max_tokens (plus a token-id prompt, whose length is known) does
    not fit the context; text prompts are measured exactly by the worker, which refuses likewise."""
    if max_model_len is None or max_tokens is None:
        return
    if max_tokens > max_model_len:
        raise ContextLengthExceeded(
            f"max_tokens is {max_tokens}, but this model's maximum context length is "
            f"{max_model_len} tokens", param="max_tokens")
    for one in each_prompt(prompt):
        ids = one.get("prompt_token_ids")
        if ids is not None and len(ids) + max_tokens > max_model_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {max_model_len} tokens, but you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
                f"completion)", param="max_tokens")


def check_peer_features(entry: protocol.RequestEntry, schema: int | None) -> None:
    """503 while the entry would be written in a schema that drops a feature the request uses (a
    worker of the previous release still serves the stream, or no live worker has said which it
    speaks): never a silent drop. Retryable: in a rolling upgrade the old workers are leaving."""
    missing = protocol.missing_features(entry, protocol.peer_version(schema))
    if not missing:
        return
    who = (f"a worker of this model's previous release (protocol schema {schema}) still serves it"
           if schema is not None else "no live worker of this model version has said it serves them")
    raise Overloaded(f"{', '.join(missing)}: {who}; retry shortly", param=missing[0],
                     code="upgrade_in_progress", retry_after=5)
