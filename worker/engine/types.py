"""The engine API's value types, shared by every engine (paged and the naive `hf` baseline).
SamplingParams is defined in shared/sampling.py: the gateway and the wire derive from it too."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from shared.sampling import SamplingParams  # noqa: F401  (part of the engine API)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first
    rank: int | None = None  # 1 + how many tokens were likelier (prompt logprobs carry it, as vLLM's)


@dataclass
class RequestError:
    """Why the engine ended one request early; the service turns it into the request's error reply."""

    code: str  # a shared.errors code: engine_error, engine_step_failed, ...
    message: str
    retryable: bool = False  # the same request may succeed if sent again
    param: str | None = None  # the request field at fault, where one is


@dataclass
class RequestOutput:
    """What one step produced for one choice of one request (only choices that changed)."""

    request_id: str
    index: int  # choice index, 0..n-1
    new_token_ids: list[int]
    text: str  # newly released text (never half a UTF-8 character, never a possible stop prefix)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far for this choice
    error: RequestError | None = None  # set (once per request) when the whole request failed
    # once, on choice 0's first output of a request that asked: one entry per prompt token
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_token_ids: list[int] | None = None  # with prompt_logprobs: the tokens they score
    embedding: bytes | None = None  # an embedding input's vector, little-endian float32 (pooling.py)


@dataclass
class Resume:
    """Where a request taken over from a dead worker continues: the tokens each choice already
    sent, re-prefilled with the prompt; seeded draws continue at the same counters."""

    output_ids: dict[int, list[int]] = field(default_factory=dict)  # choice index → emitted ids
    finished: set[int] = field(default_factory=set)  # choices that already ended


class EngineRejected(ValueError):
    """A request that can never run (too long for the model or the KV pool, a number or token id out
    of range); the message names the numbers, `code` and `param` say which error the client gets."""

    def __init__(self, message: str, code: str = "context_length_exceeded", param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


class Engine(Protocol):
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    resume: Resume | None = None, tenant: str | None = None, to_context: bool = False) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished(self) -> bool: ...

    def free_capacity(self) -> int:
        """How many more requests the engine can take right now (pull-based load balancing)."""
        ...

    def stats(self) -> dict: ...
