"""What every engine (paged, the naive `hf` baseline, the synthetic one) says about its model,
and the admission check they share, so all three reject the same requests with the same words."""
from __future__ import annotations

from worker.engine.types import EngineRejected, SamplingParams


class ModelFacts:
    def __init__(self, tokenizer, eos_token_ids, max_model_len: int):
        self._tokenizer = tokenizer
        self._eos_token_ids = set(eos_token_ids)
        self._max_model_len = max_model_len

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def eos_token_ids(self) -> set[int]:
        return self._eos_token_ids

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def check_context(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Reject what could never run, naming the numbers; return prompt + max_tokens."""
        if not prompt_ids:
            raise EngineRejected("the prompt has 0 tokens; at least 1 is needed")
        total = len(prompt_ids) + params.max_tokens
        if total > self._max_model_len:
            raise EngineRejected(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
                f"exceeds max_model_len of {self._max_model_len} tokens")
        return total
