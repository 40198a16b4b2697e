"""A deliberately fast SYNTHETIC engine, for load tests of the serving path only (never for answers).

No model and no compute: every step emits one fixed token for every unfinished choice at once (no
batch cap), until each reaches its `max_tokens`. What remains to be measured is everything around
the engine: HTTP, auth, limits, Redis, the worker loop. The tokenizer is the model folder's, so
prompts are tokenized (and counted) exactly as the real engines do.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from worker.engine.base import ModelFacts, prompt_params, prompts_of
from worker.engine.tokenizer import eos_token_ids, load_tokenizer
from worker.engine.types import RequestOutput, Resume, SamplingParams, TokenLogprob


@dataclass
class _Choice:
    request_id: str
    index: int
    num_prompt_tokens: int
    params: SamplingParams
    num_output_tokens: int = 0


class SyntheticEngine(ModelFacts):
    def __init__(self, tokenizer, eos_ids: set[int], max_model_len: int, vocab_size: int,
                 max_num_seqs: int = 1024):
        super().__init__(tokenizer, eos_ids, max_model_len, vocab_size)
        self.max_num_seqs = max_num_seqs
        self.token_id, self.token_text = self._fixed_token(tokenizer, self._eos_token_ids)
        self.choices: dict[str, list[_Choice]] = {}
        self._aborted: list[RequestOutput] = []  # reported on the next step

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, max_model_len: int | None = None,
                       max_num_seqs: int = 1024) -> SyntheticEngine:
        tokenizer = load_tokenizer(model_dir)
        config = json.loads((Path(model_dir) / "config.json").read_text())
        max_len = max_model_len or config.get("max_position_embeddings", 4096)
        vocab_size = config.get("vocab_size") or len(tokenizer)
        return cls(tokenizer, eos_token_ids(model_dir, tokenizer), max_len, vocab_size, max_num_seqs)

    @staticmethod
    def _fixed_token(tokenizer, eos_ids: set[int]) -> tuple[int, str]:
        """The first token of " the": ordinary text in any tokenizer, and never an EOS id."""
        ids = [i for i in tokenizer.encode(" the", add_special_tokens=False) if i not in eos_ids]
        token = ids[0] if ids else 0
        return token, tokenizer.decode([token])

    def add_request(self, request_id: str, prompt_ids: list[int] | list[list[int]], params: SamplingParams,
                    resume: Resume | None = None, tenant: str | None = None, to_context: bool = False) -> None:
        """A resumed request continues each unfinished choice after the tokens it already sent."""
        self.check_request(prompt_ids, params, resume)
        if request_id in self.choices:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        resume = resume or Resume()
        choices = [_Choice(request_id, p * params.n + i, len(prompt),
                           prompt_params(params, prompt, self.max_model_len, to_context),
                           len(resume.output_ids.get(p * params.n + i, [])))
                   for p, prompt in enumerate(prompts_of(prompt_ids)) for i in range(params.n)
                   if p * params.n + i not in resume.finished]
        if choices:
            self.choices[request_id] = choices

    def abort(self, request_id: str) -> None:
        for c in self.choices.pop(request_id, []):
            self._aborted.append(self._output(c, [], "", "abort"))

    def has_unfinished(self) -> bool:
        return bool(self.choices or self._aborted)

    def free_capacity(self) -> int:
        return max(0, self.max_num_seqs - sum(len(c) for c in self.choices.values()))

    def stats(self) -> dict:
        running = sum(len(c) for c in self.choices.values())
        return {"num_running": running, "num_waiting": 0, "kv_usage": 0.0, "prefix_cache_queries": 0,
                "prefix_cache_hits": 0, "num_preemptions": 0}

    def step(self) -> list[RequestOutput]:
        """One fixed token for every unfinished choice; a choice ends at max_tokens ("length")."""
        outputs, self._aborted = self._aborted, []
        for request_id, choices in list(self.choices.items()):
            for c in choices:
                c.num_output_tokens += 1
                done = c.num_output_tokens >= c.params.max_tokens
                outputs.append(self._output(c, [self.token_id], self.token_text, "length" if done else None))
            if left := [c for c in choices if c.num_output_tokens < c.params.max_tokens]:
                self.choices[request_id] = left
            else:
                del self.choices[request_id]
        return outputs

    def _output(self, c: _Choice, new_ids: list[int], text: str, reason: str | None) -> RequestOutput:
        logprobs = None
        if c.params.logprobs is not None and new_ids:
            logprobs = [TokenLogprob(self.token_id, 0.0, [(self.token_id, 0.0)][:c.params.logprobs])]
        return RequestOutput(
            request_id=c.request_id, index=c.index, new_token_ids=new_ids, text=text,
            finished=reason is not None, finish_reason=reason, logprobs=logprobs,
            num_prompt_tokens=c.num_prompt_tokens, num_output_tokens=c.num_output_tokens)
