"""The sampling parameters of one request, defined once: the engine reads this dataclass, the wire
model (`protocol.WireParams`) is derived from its fields, and the gateway's request models fill it
by field name (`gateway/schemas.py`). A plain dataclass, because the engine's GPU image has no
pydantic (tests/ops/test_gpu_image_imports.py); only the engine's checks and the gateway's bounds
say which values are valid.

Two marks in a field's metadata say how it travels (the wire keeps the shape schema 1 had):
OPTIONAL: absent on the wire means what `why` says, resolved by the worker; ON_ENTRY: carried on the
request entry beside `params`, not in it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

GREEDY_TEMPERATURE = 1e-5
OPTIONAL, ON_ENTRY = "optional", "on_entry"
# what a model folder's generation_config.json may set the default of, for a request that leaves it
# out (worker/model_defaults.py; vLLM's list, less max_new_tokens)
MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


SCHEMA_DEPTH = 64  # JSON nesting of a schema: compile time grows steeply with it (depth 1000: 40 s)


def json_depth(value) -> int:
    """How deep JSON containers nest in `value` (iteratively: a deep one must not blow the stack)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            todo.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


@dataclass
class StructuredOutputs:
    """What the output must match (vLLM's `structured_outputs`): exactly one of these is set. The
    gateway fills it from `response_format`, `structured_outputs`, the `guided_*` spellings or a
    tool_choice; the engine compiles it to a grammar and masks the logits with it."""

    json: str | None = None  # a JSON schema, as JSON text (the compile cache keys on it)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # the whole output is one of these strings
    grammar: str | None = None  # EBNF (xgrammar's dialect, GBNF-compatible)


@dataclass
class SamplingParams:
    max_tokens: int = field(default=16, metadata={OPTIONAL: "as many as the context leaves"})
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: off; k >= 0: the sampled token's logprob plus top-k
    # None: off; k >= 0: each prompt token's logprob (and rank) plus the top-k (vLLM's); the first is None
    prompt_logprobs: int | None = None
    # prompt positions before this get None and may be served from the prefix cache (SGLang's
    # logprob_start_len): scoring a continuation recomputes only from the block holding it; None: 0
    prompt_logprobs_start: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    n: int = 1
    structured_outputs: StructuredOutputs | None = None  # None: free text
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    # lower value = more important (served first, preempted last)
    priority: int = field(default=0, metadata={ON_ENTRY: True})
    # isolates prefix-cache entries per tenant (set from the API key, not the request)
    cache_salt: str | None = field(default=None, metadata={ON_ENTRY: True})

    @property
    def greedy(self) -> bool:
        """Below GREEDY_TEMPERATURE, logits / temperature overflow to inf (a 1e-238 temperature is a
        valid request): such a row is greedy, as vLLM treats temperatures under its epsilon."""
        return self.temperature < GREEDY_TEMPERATURE
