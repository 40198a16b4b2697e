"""No silent ignoring: a request field that changes what the model should produce and that kvgate
does not implement is refused with a 400 naming it, rather than dropped (an agent would get free
text where it asked for something else). One list, a reason per field. A field the route declares
is implemented, but for the values a rule's `when` picks; one it does not declare arrives as an
extra, refused when it is present and not null (or when `when` picks its value). Fields that only
label a request (user, metadata, store, service_tier, safety_identifier, prompt_cache_key) are not
listed: they stay accepted."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from shared.errors import InvalidRequest


@dataclass(frozen=True)
class Refused:
    field: str
    reason: str
    when: Callable[[Any, Any], bool] | None = None  # (value, body) -> refused; None: any non-null extra


REFUSED = (
    Refused("functions", "legacy function calling is not supported; send `tools`"),
    Refused("function_call", "legacy function calling is not supported; send `tool_choice`"),
    Refused("audio", "audio output is not supported"),
    Refused("modalities", "only text output is supported",
            lambda v, _: v is not None and list(v) != ["text"]),
    Refused("prediction", "predicted outputs are not supported"),
    Refused("web_search_options", "web search is not supported"),
    Refused("reasoning_effort", "reasoning_effort is served on /v1/chat/completions"),  # completions
    Refused("verbosity", "verbosity is not supported"),
    Refused("best_of", "best_of above 1 is not supported; use n", lambda v, _: v not in (None, 1)),
    Refused("suffix", "suffix (insertion) is not supported"),
    Refused("guided_decoding_backend", "the grammar backend is the server's choice (xgrammar)"),
    Refused("guided_whitespace_pattern", "a whitespace pattern for JSON is not supported"),
    Refused("top_logprobs", "top_logprobs needs logprobs: true",
            lambda v, body: v is not None and not getattr(body, "logprobs", None)),
    # on /v1/completions, where these are not declared: only chat renders a template
    Refused("tools", "tools are served on /v1/chat/completions"),
    Refused("tool_choice", "tool_choice is served on /v1/chat/completions"),
    Refused("chat_template_kwargs", "chat_template_kwargs apply on /v1/chat/completions"),
    # on /v1/chat/completions, where these are not declared: a prompt is scored as text
    Refused("echo", "echo is served on /v1/completions"),
    Refused("prompt_logprobs", "prompt_logprobs are served on /v1/completions"),
    Refused("prompt_logprobs_start", "prompt_logprobs_start is served on /v1/completions"),
)


def check_supported(body) -> None:
    """400 naming the first field the request sets that kvgate would otherwise ignore."""
    for rule in REFUSED:
        if _refused(rule, body):
            raise InvalidRequest(f"{rule.field}: {rule.reason}", param=rule.field,
                                 code="unsupported_parameter")


def _refused(rule: Refused, body) -> bool:
    extra = body.model_extra or {}
    if rule.field in _declared(type(body)):
        return rule.when is not None and rule.when(getattr(body, rule.field), body)
    if rule.field not in extra:
        return False
    value = extra[rule.field]
    return value is not None if rule.when is None else rule.when(value, body)


@cache
def _declared(schema: type) -> frozenset[str]:
    """The fields a request schema declares, once per schema: pydantic's `model_fields` is a
    deprecation-checking property (~0.4 µs a read), read once per rule it was half of the check."""
    return frozenset(schema.model_fields)


# what chat and completions take (OpenAI's and vLLM's) that changes the output, and that the
# Responses and Messages APIs do not have: sent to either, refused by name (with that API's own
# spelling where it has one), not dropped
CHAT_ONLY = ("stop", "n", "logit_bias", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "min_p", "min_tokens", "stop_token_ids", "ignore_eos",
             "include_stop_str_in_output", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
             "guided_grammar", "response_format", "chat_template_kwargs", "max_tokens", "max_completion_tokens",
             "best_of", "echo", "suffix", "prompt_logprobs", "reasoning_effort", "allowed_token_ids",
             "bad_words", "skip_special_tokens")
# their values that change nothing (a client that sends chat's defaults along is not refused)
NEUTRAL = {"n": 1, "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1,
           "min_p": 0, "min_tokens": 0, "ignore_eos": False, "include_stop_str_in_output": False, "best_of": 1,
           "echo": False, "skip_special_tokens": True, "stop": [], "stop_token_ids": [], "logit_bias": {}}


def refuse_chat_fields(body, api: str, spelled: dict[str, str]) -> None:
    """400 naming the first chat-only field `body` (a schema that keeps its extras) sets."""
    extra = body.model_extra or {}
    for name in CHAT_ONLY:
        value = extra.get(name)
        if value is not None and name not in _declared(type(body)) and value != NEUTRAL.get(name, object()):
            hint = f"; {api} spells it {spelled[name]}" if name in spelled else ""
            raise InvalidRequest(f"{name} is not a {api} field (it is chat completions'): it would change the "
                                 f"output, so it is refused rather than ignored{hint}", param=name,
                                 code="unsupported_parameter")
