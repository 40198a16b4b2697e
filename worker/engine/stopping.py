"""When a choice is done, decided from the token just produced (stop strings live in the detokenizer)."""
from __future__ import annotations

from collections.abc import Container

from worker.engine.types import SamplingParams


def check_finish(
    token_id: int, num_output_tokens: int, params: SamplingParams, eos_token_ids: Container[int]
) -> str | None:
    """"stop", "length" or None; `num_output_tokens` counts `token_id` itself. None of the first
    min_tokens tokens stops the choice: the sampler holds stop ids and EOS back from them, and one it
    lets through because the grammar allows nothing else (sampler.py) is text, unless it ends the grammar."""
    if num_output_tokens > params.min_tokens:
        if token_id in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token_id in eos_token_ids:
            return "stop"
    if num_output_tokens >= params.max_tokens:
        return "length"
    return None


def release_text(detok, token: int, reason: str | None, include_stop: bool) -> tuple[str, str | None]:
    """Text a new token releases, and the finish reason: a stop token's own text is left out
    unless asked for, as vLLM does; a stop string wins."""
    if reason == "stop" and not include_stop:
        return detok.flush(), reason
    text = detok.add([token])
    if detok.stopped:
        return text, "stop"
    return (text + detok.flush(), reason) if reason else (text, None)
