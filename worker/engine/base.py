"""What every engine (paged, the naive `hf` baseline, the synthetic one) says about its model,
the admission check they share, so all three reject the same requests with the same words, and the
errors they end a failed request with.

The check is defence in depth: the gateway validates first, but an older gateway, a batch line or a
takeover may hand the worker anything, and one out-of-range number must end its own request, not
the engine (an id past the embedding raises inside the batched forward pass, and on a GPU it is a
device-side assert that takes the whole process's CUDA context with it).
"""
from __future__ import annotations

import dataclasses
import logging
import math

from worker.engine.kv_budget import NO_KV_FIELDS, KVCacheFacts
from worker.engine.types import EngineRejected, RequestError, Resume, SamplingParams

log = logging.getLogger("kvgate.worker")

MAX_N = 16  # choices per request: each is a sequence with its own KV
# One request's prompt_logprobs travel in one reply message: ~130 bytes a prompt token and ~50 a
# top entry of a scored one (measured on the wire). Redis drops a subscriber it must send more than
# 32 MB at once, or over 8 MB for a minute (client-output-buffer-limit pubsub), and with it every
# stream of that gateway: a request whose scores would come to more than this is refused.
MAX_PROMPT_SCORES_BYTES = 8 << 20


class ModelFacts:
    kv_cache: KVCacheFacts | None = None  # the paged engine's pool; none in hf and synthetic
    constrains = False  # compiles structured_outputs (the paged engine); the others refuse them
    scores_prompts = False  # computes prompt_logprobs (the paged engine); the others refuse them

    def __init__(self, tokenizer, eos_token_ids, max_model_len: int, vocab_size: int):
        self._tokenizer = tokenizer
        self._eos_token_ids = set(eos_token_ids)
        self._max_model_len = max_model_len
        self._vocab_size = vocab_size

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def eos_token_ids(self) -> set[int]:
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return getattr(self._tokenizer, "bos_token_id", None)

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def kv_cache_fields(self) -> dict:
        """The registry entry's kv_* fields (None where the engine has no paged pool)."""
        return self.kv_cache.registry_fields() if self.kv_cache else dict(NO_KV_FIELDS)

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding: the token ids the model accepts are [0, vocab_size)."""
        return self._vocab_size

    def check_request(self, prompt_ids: list[int] | list[list[int]], params: SamplingParams,
                      resume: Resume | None = None) -> None:
        """Reject what could never run or could crash the engine, naming the number and its limit.
        `prompt_ids`: one prompt, or a batched completion's prompts (`prompts_of`)."""
        prompts = prompts_of(prompt_ids)
        if len(prompts) > 1 and len(prompts) * params.n > MAX_N:  # (n alone: _check_numbers says it)
            raise EngineRejected(f"{len(prompts)} prompts x n ({params.n}) = {len(prompts) * params.n} choices; "
                                 f"at most {MAX_N} a request (each is a sequence with its own KV)",
                                 "invalid_request", "prompt")
        for index, prompt in enumerate(prompts):
            self._check_ids("prompt token id" if len(prompts) == 1 else f"prompt {index}'s token id", prompt,
                            "prompt")
        self._check_ids("stop_token_ids value", params.stop_token_ids, "stop_token_ids")
        for index, ids in (resume.output_ids.items() if resume else ()):
            self._check_ids(f"token id resumed for choice {index}", ids, None, code="resume_failed")
        _check_numbers(params, self._vocab_size)
        self._check_logit_bias(params.logit_bias or {})
        if params.structured_outputs is not None and not self.constrains:
            raise EngineRejected(f"structured_outputs need the paged engine; this worker runs "
                                 f"{type(self).__name__}", "invalid_structured_output", "structured_outputs")
        if params.max_tokens == 0 and not self.scores_prompts:
            raise EngineRejected(f"max_tokens 0 (the prompt scored, nothing generated) needs the paged engine; "
                                 f"this worker runs {type(self).__name__}", "invalid_request", "max_tokens")
        if params.prompt_logprobs is not None and not self.scores_prompts:
            raise EngineRejected(f"prompt_logprobs need the paged engine; this worker runs "
                                 f"{type(self).__name__}", "invalid_request", "prompt_logprobs")
        _check_prompt_scores([len(prompt) for prompt in prompts], params)
        for prompt in prompts:
            self._check_context(prompt, params)

    def _check_logit_bias(self, bias: dict[int, float]) -> None:
        for token, value in bias.items():
            if not (isinstance(token, int) and 0 <= token < self._vocab_size):
                raise EngineRejected(f"logit_bias token id {token!r} is outside this model's vocabulary "
                                     f"[0, {self._vocab_size})", "invalid_request", "logit_bias")
            if not math.isfinite(value):
                raise EngineRejected(f"logit_bias for token id {token} must be a finite number; got "
                                     f"{value!r}", "invalid_request", "logit_bias")

    def check_pooled_inputs(self, prompts: list[list[int]], what: str, param: str | None) -> None:
        """An embedding's inputs or a score's pairs (`what`: "input", "pair"): each 1 to max_model_len
        tokens inside the vocabulary."""
        for index, prompt in enumerate(prompts):
            self._check_ids(f"{what} token id" if len(prompts) == 1 else f"{what} {index}'s token id", prompt, param)
            if not 1 <= len(prompt) <= self._max_model_len:
                raise EngineRejected(f"{what} {index} has {len(prompt)} tokens; this model's maximum context "
                                     f"length is {self._max_model_len} tokens (and each {what} has at least 1)",
                                     param=param)

    def _check_ids(self, what: str, ids: list[int], param: str | None,
                   code: str = "invalid_request") -> None:
        for position, token in enumerate(ids):
            if not 0 <= token < self._vocab_size:
                raise EngineRejected(f"{what} {token} at position {position} is outside this model's "
                                     f"vocabulary [0, {self._vocab_size})", code, param)

    def _check_context(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise EngineRejected("the prompt has 0 tokens; at least 1 is needed", "invalid_request", "prompt")
        total = len(prompt_ids) + params.max_tokens
        if total > self._max_model_len:
            raise EngineRejected(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
                f"exceeds max_model_len of {self._max_model_len} tokens")


def prompt_params(params: SamplingParams, prompt: list[int], max_model_len: int, to_context: bool) -> SamplingParams:
    """A prompt's choices' parameters: a request that set no max_tokens (`to_context`) runs each
    prompt's choices to the end of the context, as vLLM does, not to the room the batch's longest
    prompt leaves (what `params` carries, and what the request was checked with)."""
    return dataclasses.replace(params, max_tokens=max_model_len - len(prompt)) if to_context else params


def prompts_of(prompt_ids: list[int] | list[list[int]]) -> list[list[int]]:
    """A request's prompts: one prompt's ids, or a batched completion's list of prompts (prompt p's
    choices are p*n .. p*n+n-1, OpenAI's order)."""
    return prompt_ids if prompt_ids and isinstance(prompt_ids[0], list) else [prompt_ids]


def _check_prompt_scores(lengths: list[int], p: SamplingParams) -> None:
    """The prompts' scores of one request are held and sent together: bounded all together."""
    if p.prompt_logprobs is None:
        return
    prompt_tokens = sum(lengths)
    # as Sequence scores: from prompt_logprobs_start on, never the first token
    scored = sum(max(n - max((p.prompt_logprobs_start or 0) - 1, 0) - 1, 0) for n in lengths)
    size = prompt_tokens * 130 + scored * p.prompt_logprobs * 50
    if size > MAX_PROMPT_SCORES_BYTES:
        raise EngineRejected(
            f"prompt_logprobs of {prompt_tokens} prompt tokens, {scored} of them scored with "
            f"{p.prompt_logprobs} top entries each, come to about {size / 2**20:.1f} MB in one reply; "
            f"the limit is {MAX_PROMPT_SCORES_BYTES / 2**20:g} MB: score fewer tokens "
            "(prompt_logprobs_start) or ask for fewer top entries", "invalid_request", "prompt_logprobs")


def _check_numbers(p: SamplingParams, vocab_size: int) -> None:
    """Each bound is one the sampler or scheduler needs (a NaN or a negative k would raise or sample
    garbage), not a policy: the gateway's schema sets the policy bounds."""
    def refuse(param: str, rule: str, value) -> None:
        raise EngineRejected(f"{param} must be {rule}; got {value!r}", "invalid_request", param)

    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if not math.isfinite(getattr(p, name)):
            refuse(name, "a finite number", getattr(p, name))
    if p.max_tokens < 0:
        refuse("max_tokens", "0 (the prompt scored, nothing generated) or more", p.max_tokens)
    if not 0 <= p.min_tokens <= p.max_tokens:
        refuse("min_tokens", f"between 0 and max_tokens ({p.max_tokens})", p.min_tokens)
    if not 1 <= p.n <= MAX_N:
        refuse("n", f"between 1 and {MAX_N}", p.n)
    if p.logprobs is not None and not 0 <= p.logprobs <= vocab_size:
        refuse("logprobs", f"between 0 and the vocabulary size ({vocab_size})", p.logprobs)
    if p.prompt_logprobs is not None and not 0 <= p.prompt_logprobs <= vocab_size:
        refuse("prompt_logprobs", f"between 0 and the vocabulary size ({vocab_size})", p.prompt_logprobs)
    if p.prompt_logprobs_start is not None and p.prompt_logprobs_start < 0:
        refuse("prompt_logprobs_start", "0 or more", p.prompt_logprobs_start)
    if p.top_k < -1:
        refuse("top_k", "-1 or 0 (off) or a positive number of tokens", p.top_k)
    if p.temperature < 0:
        refuse("temperature", "0 or more", p.temperature)
    if not 0 < p.top_p <= 1:
        refuse("top_p", "in (0, 1]", p.top_p)
    if not 0 <= p.min_p <= 1:
        refuse("min_p", "in [0, 1]", p.min_p)
    if p.repetition_penalty <= 0:
        refuse("repetition_penalty", "greater than 0", p.repetition_penalty)


def request_error(request_id: str, exc: Exception) -> RequestError:
    """One request failed, and only it ends: refused for a reason it names (`EngineRejected`: its
    code, a 4xx), or for an unknown one, logged with its id (never its text) and answered as a 500."""
    if isinstance(exc, EngineRejected):
        return RequestError(exc.code, str(exc), param=exc.param)
    log.error("request %s failed in the engine (%s); it ends alone", request_id, type(exc).__name__,
              exc_info=exc, extra={"request_id": request_id})
    return RequestError("request_failed", f"the engine failed on this request ({type(exc).__name__}); "
                        "it was ended alone")


def step_error(exc: Exception, num_requests: int) -> RequestError:
    """A forward pass failed: no one request can be blamed, so each of the step's ends with this
    retryable error (sent again, it will most likely run in a step that works)."""
    log.error("an engine step with %d requests failed (%s); they end with a retryable error",
              num_requests, type(exc).__name__, exc_info=exc)
    return RequestError("engine_step_failed", f"the engine step running this request failed "
                        f"({type(exc).__name__}); sending it again may succeed", retryable=True)
