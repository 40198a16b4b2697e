"""Every bound on what a client may send to the OpenAI routes, in one place.

The request schemas (gateway/schemas.py) enforce these, so no number reaches JSON encoding, Redis
or the engine out of range, and no string makes work proportional to its length beyond the body
limit. README's API section lists them (a test checks it does). Bounds that depend on the model
(its vocabulary and context) are checked against the facts its workers register
(gateway/validation.py), after routing.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.names import MODEL_NAME_CHARS  # the batch runner checks it too
from shared.sampling import SCHEMA_DEPTH  # noqa: F401  (the engine checks it too)


@dataclass(frozen=True)
class Bound:
    field: str  # as the client spells it
    low: int | float | None
    high: int | float | None
    note: str = ""


INT64_MAX = 2**63 - 1
TOKEN_ID_MAX = 2**31 - 1  # beyond any vocabulary; the model's own is checked after routing

MAX_TOKENS = 1 << 24  # above any context length; the model's context is checked after routing
TOP_K = 1 << 20  # a top_k at or above the vocabulary size filters nothing
N = 16
STOP_SEQUENCES = 4
STOP_CHARS = 512  # the detokenizer holds back up to this much text while a stop may still match
STOP_TOKEN_IDS = 64
PROMPT_TOKEN_IDS = 1 << 20
MESSAGES = 10_000
LOGPROBS = 20
USER_CHARS = 512
PRIORITY = 100
LOGIT_BIAS = 300  # token ids a request may bias, as OpenAI allows
LOGIT_BIAS_VALUE = 100
SCHEMA_CHARS = 1 << 15  # a JSON schema's text (response_format, structured_outputs, a tool's parameters)
REGEX_CHARS = 4096
GRAMMAR_CHARS = 1 << 15
CHOICES = 256
CHOICE_CHARS = 1024
TOOLS = 128  # as OpenAI allows
TOOL_NAME_CHARS = 64  # as OpenAI allows: letters, digits, _ and -
DESCRIPTION_CHARS = 4096
TOOL_CALLS = 128  # calls one assistant message may carry
TOOL_CALL_ID_CHARS = 256
TEMPLATE_KWARGS = 32
TEMPLATE_KWARGS_CHARS = 4096  # chat_template_kwargs as JSON text
TEMPLATE_KWARGS_DEPTH = 16  # and nested at most this deep
REPETITION_PENALTY_MIN = 0.01  # a smaller one rounds to 0 in float32 (below ~1e-45), or makes logits overflow
TOOL_ARGUMENTS_DEPTH = SCHEMA_DEPTH  # messages[].tool_calls[].function.arguments: JSON nested at most this deep

BOUNDS = (
    Bound("model", 1, MODEL_NAME_CHARS, "characters"),
    Bound("max_tokens, max_completion_tokens", 1, MAX_TOKENS,
          "and prompt + max_tokens ≤ the model's context (400 context_length_exceeded)"),
    Bound("min_tokens", 0, MAX_TOKENS, "and ≤ max_tokens when that is given"),
    Bound("n", 1, N, "choices; n × max_tokens is bounded by n × the context"),
    Bound("temperature", 0, 2),
    Bound("top_p", 0, 1, "greater than 0"),
    Bound("top_k", -1, TOP_K, "-1 or 0: off; at or above the vocabulary: off"),
    Bound("min_p", 0, 1),
    Bound("presence_penalty, frequency_penalty", -2, 2),
    Bound("repetition_penalty", REPETITION_PENALTY_MIN, 10, "the seen tokens' logits are scaled by it, in float32"),
    Bound("seed", 0, INT64_MAX),
    Bound("priority", -PRIORITY, PRIORITY, "lower is served first; a key may ask only for its "
          "own best priority or worse"),
    Bound("stop", 0, STOP_SEQUENCES, f"strings, each 1 to {STOP_CHARS} characters"),
    Bound("stop_token_ids", 0, STOP_TOKEN_IDS, "ids, each in [0, the model's vocabulary size)"),
    Bound("prompt (token ids)", 1, PROMPT_TOKEN_IDS, "ids, each in [0, the model's vocabulary size); a batch's "
          "id lists hold at most as many all together"),
    Bound("prompt (a batch: strings or id lists)", 1, N, "prompts, each with its n choices: prompts × n ≤ "
          f"{N}; a batch of one is that prompt"),
    Bound("messages", 1, MESSAGES, "messages; content is a string or a list of text parts"),
    Bound("logprobs, prompt_logprobs (completions), top_logprobs (chat)", 0, LOGPROBS),
    Bound("user", 0, USER_CHARS, "characters"),
    Bound("logit_bias", 0, LOGIT_BIAS, f"token ids, each in [0, the model's vocabulary size), each "
          f"biased by -{LOGIT_BIAS_VALUE} to {LOGIT_BIAS_VALUE}"),
    Bound("response_format.json_schema.schema, structured_outputs.json, guided_json, "
          "tools[].function.parameters", 0, SCHEMA_CHARS, f"characters of JSON text, nested at most "
          f"{SCHEMA_DEPTH} deep; a valid JSON schema that compiles (400 otherwise)"),
    Bound("structured_outputs.regex, guided_regex", 1, REGEX_CHARS, "characters; must compile (400)"),
    Bound("structured_outputs.grammar, guided_grammar", 1, GRAMMAR_CHARS, "characters of EBNF; must "
          "compile (400)"),
    Bound("structured_outputs.choice, guided_choice", 1, CHOICES, f"strings, each 1 to {CHOICE_CHARS} "
          "characters"),
    Bound("tools", 0, TOOLS, f"function tools; names 1 to {TOOL_NAME_CHARS} of a-z A-Z 0-9 _ -, "
          "distinct"),
    Bound("tools[].function.description, response_format.json_schema.description", 0,
          DESCRIPTION_CHARS, "characters"),
    Bound("messages[].tool_calls", 0, TOOL_CALLS, f"calls; ids and tool_call_id up to "
          f"{TOOL_CALL_ID_CHARS} characters; function.arguments JSON text (strict: no NaN, no lone "
          f"surrogate) of at most {SCHEMA_CHARS} characters, nested at most {TOOL_ARGUMENTS_DEPTH} deep"),
    Bound("chat_template_kwargs", 0, TEMPLATE_KWARGS, f"keys, at most {TEMPLATE_KWARGS_CHARS} "
          f"characters as JSON, nested at most {TEMPLATE_KWARGS_DEPTH} deep; the template's own "
          "arguments (messages, tools, "
          "add_generation_prompt, tokenize, …) are refused"),
)


def _shown(value: int | float | None) -> str:
    if isinstance(value, int) and value >= 1 << 16:
        exponent = value.bit_length()
        if value == 1 << (exponent - 1):
            return f"2^{exponent - 1}"
        if value == (1 << exponent) - 1:
            return f"2^{exponent}−1"
    return "—" if value is None else str(value)


def readme_row(bound: Bound) -> str:
    """The bound's row in README's table (a test keeps the two the same)."""
    return f"| `{bound.field}` | {_shown(bound.low)} | {_shown(bound.high)} | {bound.note} |"
