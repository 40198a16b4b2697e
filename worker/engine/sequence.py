"""One choice of one request: its tokens, how many of them the KV cache holds, and its blocks."""
from __future__ import annotations

import itertools
from enum import Enum

from worker.engine.types import SamplingParams


class SequenceStatus(Enum):
    COMPILING = "compiling"  # waits for its grammar, outside the scheduler (compiling.py)
    QUEUED = "queued"  # an embedding input waiting for its request's turn, outside the scheduler (pooling.py)
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    _arrivals = itertools.count()

    def __init__(self, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams):
        self.seq_id = next(Sequence._arrivals)  # also the arrival order: smaller is older
        self.request_id = request_id
        self.index = index  # choice index within the request
        self.params = params
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        # v1 model: no prefill or decode phase, just how far the cache is behind the tokens.
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of prompt + output
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.detokenizer = None  # set by the engine
        self.constraint = None  # its grammar state (constraint.py), set once the grammar compiled
        # prompt position -> its logprob while the prompt is scored (a prompt's first choice, in a
        # request with prompt_logprobs, until its first token reports them); None: nothing (more) to score
        first = index % params.n == 0
        self.prompt_scores: dict | None = {} if first and params.prompt_logprobs is not None else None
        self.embed = None  # an embedding input's pooling.Embed: it pools its prompt instead of sampling
        self.pooled = None  # its pooled state so far (a float32 tensor on the CPU)

    @property
    def prefill_only(self) -> bool:
        """Its prompt is computed and nothing is sampled: an embedding input, or a request with
        max_tokens 0 (its prompt scored, OpenAI's legacy echo without a completion)."""
        return self.embed is not None or self.params.max_tokens == 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def priority_key(self) -> tuple[int, int]:
        """Served in ascending order; preempted from the end (lowest priority, then newest)."""
        return self.params.priority, self.seq_id

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def scored_span(self, start: int, end: int) -> range:
        """Positions among [start, end) whose logits score a prompt token (position j scores token
        j + 1), when this sequence scores its prompt."""
        if self.prompt_scores is None:
            return range(0)
        return range(max(start, self._first_scorer), min(end, self.num_prompt_tokens - 1))

    def cacheable_tokens(self) -> int:
        """How many leading tokens may come from the prefix cache: a scored prompt needs the logits of
        every position from prompt_logprobs_start - 1 on, so those are computed, not read; a mean of
        the states needs them all."""
        if self.embed is not None and self.embed.mode == "mean":
            return 0
        if self.prompt_scores is None:
            return self.num_tokens
        return self._first_scorer

    @property
    def _first_scorer(self) -> int:
        """The first position whose logits score a prompt token."""
        return max((self.params.prompt_logprobs_start or 0) - 1, 0)

    def take_prompt_logprobs(self) -> list | None:
        """The scores, one per prompt token (None where unscored), once; then scoring is over."""
        scores, self.prompt_scores = self.prompt_scores, None
        return None if scores is None else [scores.get(i) for i in range(self.num_prompt_tokens)]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole sequence."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        head = self.prompt_ids[start:] if start < p else []
        return head + self.output_ids[max(start - p, 0):end - p]

    def append_token(self, token_id: int) -> None:
        self.output_ids.append(token_id)
