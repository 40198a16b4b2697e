"""The naive baseline engine: a plain transformers model, one choice at a time, FIFO.

Benchmarks compare the paged engine against this, so it stays simple on purpose: no batching,
no paging, no prefix cache; a DynamicCache per choice, dropped when the choice finishes.
It shares the sampler, detokenizer and stop rules with the paged engine so outputs are comparable.
"""
from __future__ import annotations

import inspect
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from worker.engine.base import ModelFacts, prompt_params, prompts_of, request_error, step_error
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.sampler import Sampler, SampleRow
from worker.engine.stopping import check_finish, release_text
from worker.engine.tokenizer import eos_token_ids, load_tokenizer
from worker.engine.types import RequestError, RequestOutput, Resume, SamplingParams, TokenLogprob


@dataclass
class _Choice:
    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    cache: object = None  # a DynamicCache once the prompt has run
    detokenizer: IncrementalDetokenizer | None = None


class HFEngine(ModelFacts):
    def __init__(self, model, tokenizer, eos_ids: set[int], max_model_len: int):
        self.model = model.eval()
        super().__init__(tokenizer, eos_ids, max_model_len, model.config.vocab_size)
        self.sampler = Sampler(self._eos_token_ids)
        self.waiting: deque[_Choice] = deque()
        self.current: _Choice | None = None
        self._aborted: list[RequestOutput] = []  # reported on the next step
        # transformers 5.x renamed `past_key_values` to `cache`; accept either generation
        forward_args = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, device: str = "cpu", dtype: str = "auto",
                       max_model_len: int | None = None) -> HFEngine:
        """`auto` picks the dtype as the paged engine does (dtype.py), so benchmarks compare like
        with like; max_model_len as given (the worker's setting), else the model's."""
        from transformers import AutoModelForCausalLM

        from worker.engine.dtype import choose_dtype
        from worker.models.config import read_model_config

        cfg = read_model_config(model_dir)
        torch_dtype, _ = choose_dtype(dtype, torch.device(device), cfg.dtype, cfg.hidden_size,
                                      cfg.intermediate_size)
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch_dtype, local_files_only=True
        ).to(device)
        tokenizer = load_tokenizer(model_dir)
        max_len = max_model_len or model.config.max_position_embeddings
        return cls(model, tokenizer, eos_token_ids(model_dir, tokenizer), max_len)

    def add_request(self, request_id: str, prompt_ids: list[int] | list[list[int]], params: SamplingParams,
                    resume: Resume | None = None, tenant: str | None = None, to_context: bool = False) -> None:
        self.check_request(prompt_ids, params, resume)
        resume = resume or Resume()
        for p, prompt in enumerate(prompts_of(prompt_ids)):
            own = prompt_params(params, prompt, self.max_model_len, to_context)
            for index in range(p * params.n, (p + 1) * params.n):
                if index not in resume.finished:
                    done = list(resume.output_ids.get(index, []))
                    self.waiting.append(_Choice(request_id, index, list(prompt), own, done))

    def abort(self, request_id: str) -> None:
        """Drop the request's choices; each unfinished one reports finish_reason "abort" next step."""
        dropped = [c for c in self.waiting if c.request_id == request_id]
        self.waiting = deque(c for c in self.waiting if c.request_id != request_id)
        if self.current is not None and self.current.request_id == request_id:
            dropped.insert(0, self.current)
            self.current = None
        self._aborted += [self._output(c, [], "", "abort", None) for c in dropped]

    def has_unfinished(self) -> bool:
        return bool(self.current or self.waiting or self._aborted)

    def free_capacity(self) -> int:
        return 0 if self.has_unfinished() else 1

    def stats(self) -> dict:
        return {
            "num_running": int(self.current is not None), "num_waiting": len(self.waiting),
            "kv_usage": 0.0, "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0,
        }

    def step(self) -> list[RequestOutput]:
        """One forward pass for the current choice (its prompt first, then one token at a time).
        A failure ends the current choice's request alone; the next step starts the next one."""
        outputs, self._aborted = self._aborted, []
        if self.current is None and self.waiting:
            choice = self.waiting.popleft()
            try:
                self.current = self._start(choice)
            except Exception as exc:
                return outputs + [self._fail(choice, request_error(choice.request_id, exc))]
        if self.current is not None:
            outputs.append(self._advance(self.current))
        return outputs

    def _start(self, choice: _Choice) -> _Choice:
        from transformers import DynamicCache

        choice.cache = DynamicCache(config=self.model.config)
        params = choice.params
        choice.detokenizer = IncrementalDetokenizer(
            self._tokenizer, choice.prompt_ids, params.stop, params.include_stop_str_in_output, params.min_tokens
        )
        for token in choice.output_ids:  # a resumed choice: replay as first released
            choice.detokenizer.add([token])
        return choice

    def _advance(self, choice: _Choice) -> RequestOutput:
        try:
            logits = self._forward(choice)
        except Exception as exc:  # the forward pass, as in the paged engine: retryable
            return self._fail(choice, step_error(exc, 1))
        try:
            return self._on_logits(choice, logits)
        except Exception as exc:
            return self._fail(choice, request_error(choice.request_id, exc))

    def _on_logits(self, choice: _Choice, logits: torch.Tensor) -> RequestOutput:
        row = SampleRow(choice.params, choice.prompt_ids, choice.output_ids, choice.index)
        (token,), (logprob,) = self.sampler(logits, [row])
        choice.output_ids.append(token)
        reason = check_finish(token, len(choice.output_ids), choice.params, self._eos_token_ids)
        text, reason = release_text(choice.detokenizer, token, reason, choice.params.include_stop_str_in_output)
        if reason is not None:
            self.current = None
        return self._output(choice, [token], text, reason, logprob)

    def _fail(self, choice: _Choice, error: RequestError) -> RequestOutput:
        """End `choice`'s whole request (its waiting choices too) with one error output."""
        self.waiting = deque(c for c in self.waiting if c.request_id != choice.request_id)
        if self.current is not None and self.current.request_id == choice.request_id:
            self.current = None  # its cache goes with it
        out = self._output(choice, [], "", "error", None)
        out.error = error
        return out

    @torch.inference_mode()
    def _forward(self, choice: _Choice) -> torch.Tensor:
        """Logits [1, V] for the next token; the cache carries everything before the new input."""
        first = choice.cache.get_seq_length() == 0  # prompt (+ tokens sent before a takeover)
        new_ids = choice.prompt_ids + choice.output_ids if first else choice.output_ids[-1:]
        input_ids = torch.tensor([new_ids], device=self.model.device)
        cache_kw = {self._cache_arg: choice.cache}  # the DynamicCache grows in place
        out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **cache_kw)
        return out.logits[:, -1, :]

    @staticmethod
    def _output(
        choice: _Choice, new_ids: list[int], text: str, reason: str | None, logprob: TokenLogprob | None
    ) -> RequestOutput:
        return RequestOutput(
            request_id=choice.request_id, index=choice.index, new_token_ids=new_ids, text=text,
            finished=reason is not None, finish_reason=reason,
            logprobs=[logprob] if logprob is not None else None,
            num_prompt_tokens=len(choice.prompt_ids), num_output_tokens=len(choice.output_ids),
        )
