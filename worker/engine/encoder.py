"""The encoder engine: embeddings and scores from a BERT-style model folder (BERT, RoBERTa,
XLM-RoBERTa: all-MiniLM, bge, e5, bge-reranker, ms-marco cross-encoders), which attends both ways
and so has nothing to page or cache: each input runs whole, once.

Each step takes inputs from the waiting requests in turn (one from each, round and round, so a
request of 2,048 inputs does not hold up one of a single input behind it; each request's shortest
first) up to the step's token budget counted with padding (inputs x the longest of them), runs
them as one right-padded batch and answers each: its vector (the folder's pooling: CLS, mean or last token, cut to `dimensions`,
normalized where the folder says) or, for a cross-encoder's (query, document) pair, its score —
the classifier head's one logit through a sigmoid, as sentence-transformers' CrossEncoder and vLLM
score them. A pair's second segment takes token type 1 from the first separator token on (what the
tokenizer's pair encoding gives, where the model has token types).

The request API is the paged engine's for pooling (`add_embedding`, `add_scoring`, `abort`,
`step`), with its bounds and words: a worker serves either folder the same way.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.engine import pooling
from worker.engine.base import ModelFacts, step_error
from worker.engine.config import EngineConfig
from worker.engine.tokenizer import load_tokenizer
from worker.engine.types import EngineRejected, RequestOutput, SamplingParams
from worker.models.bert import load_encoder, read_encoder_config
from worker.models.pooling import read_pooling, read_score_template


STEP_CONTEXTS = 8  # a step holds this many full-length inputs' worth of tokens (or max_num_batched_tokens)


@dataclass
class _Input:
    request_id: str
    index: int
    ids: list[int]
    scored: bool  # a (query, document) pair: its score, not a vector
    length: int  # its vector's dimensions


class EncoderEngine(ModelFacts):
    def __init__(self, config: EngineConfig):
        from worker.engine.dtype import choose_dtype

        if config.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size}: an encoder model runs on "
                             "one device")
        self.config = config
        self.encoder_config = cfg = read_encoder_config(config.model_dir)
        score_tokens = tuple(token for token in config.score_tokens.split(",") if token)
        self.pooling = read_pooling(config.model_dir, config.task, score_tokens)
        if self.pooling is None:
            raise ValueError(f"{config.model_dir} is an encoder ({cfg.model_type}): it embeds or scores, it does "
                             "not generate (task auto, embed or score)")
        self.device = config.torch_device()
        self.dtype, _ = choose_dtype(config.dtype, self.device, cfg.dtype, cfg.hidden_size, cfg.intermediate_size)
        self.model = load_encoder(config.model_dir, self.device, self.dtype)
        tokenizer = load_tokenizer(config.model_dir)
        positions = cfg.max_tokens  # (RoBERTa's first positions are the padding's)
        super().__init__(tokenizer, set(), min(config.max_model_len or positions, positions), cfg.vocab_size)
        self.score_template = read_score_template(config.score_template) if config.score_template else None
        # tokens a step, padding counted: no decode waits behind an encoder's step, so it is sized for
        # throughput (MiniLM-sized on 2 Xeon cores: 731 tok/s at 512 a step, 2,785 at 4,096)
        self.budget = max(config.max_num_batched_tokens or 0, STEP_CONTEXTS * self.max_model_len)
        self.waiting: dict[str, deque[_Input]] = {}  # by request, in arrival order
        self.open: dict[str, int] = {}  # each request's inputs not yet answered
        self._aborted: list[RequestOutput] = []  # reported on the next step

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, **overrides) -> EncoderEngine:
        return cls(EngineConfig(model_dir=str(model_dir), **overrides))

    @property
    def embeds(self) -> bool:
        return True

    @property
    def task(self) -> str:
        return "score" if self.pooling.scores else "embed"

    @staticmethod
    def truncate(ids: list[int], keep: int) -> list[int]:
        """An input cut to `keep` tokens (truncate_prompt_tokens): its first ones and its last, so it
        keeps the tokenizer's [CLS] ... [SEP] (<s> ... </s>) that the pooling and the model expect,
        as the tokenizer's own truncation does."""
        return ids if len(ids) <= keep else ids[:keep - 1] + ids[-1:] if keep > 1 else ids[:1]

    def add_request(self, request_id, prompt_ids, params, resume=None, tenant=None, to_context=False) -> None:
        served = "/v1/score and /v1/rerank" if self.task == "score" else "/v1/embeddings"
        raise EngineRejected(f"this model is an encoder: it serves {served}, not generation", "invalid_request",
                             "model")

    def add_embedding(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                      dimensions: int | None = None, finished: Collection[int] = (), tenant: str | None = None) -> None:
        """As the paged engine's: input i's vector is output index i."""
        if self.task != "embed":
            raise EngineRejected("this model is a reranker (/v1/score, /v1/rerank); it does not serve embeddings",
                                 "invalid_request", "model")
        length = pooling.check(self.pooling, self.encoder_config.hidden_size, len(prompts), dimensions)
        self._add(request_id, prompts, False, length, finished, "input", "input")

    def add_scoring(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                    finished: Collection[int] = (), tenant: str | None = None) -> None:
        """As the paged engine's: pair i's score is output index i."""
        if self.task != "score":
            raise EngineRejected("this model is an embedding model (/v1/embeddings); it does not score pairs",
                                 "invalid_request", "model")
        if not 1 <= len(prompts) <= pooling.MAX_INPUTS:
            raise EngineRejected(f"{len(prompts)} pairs; a request scores 1 to {pooling.MAX_INPUTS}", "invalid_request")
        self._add(request_id, prompts, True, 1, finished, "pair", None)

    def _add(self, request_id: str, prompts: list[list[int]], scored: bool, length: int, finished: Collection[int],
             what: str, param: str | None) -> None:
        self.check_pooled_inputs(prompts, what, param)
        if request_id in self.open:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        # shortest first: a step's inputs then differ little in length, so little of it is padding
        inputs = deque(sorted((_Input(request_id, i, list(p), scored, length) for i, p in enumerate(prompts)
                               if i not in finished), key=lambda item: len(item.ids)))
        if inputs:
            self.waiting[request_id], self.open[request_id] = inputs, len(inputs)

    def abort(self, request_id: str) -> None:
        """Its inputs not yet answered report finish_reason "abort" on the next step."""
        for item in self.waiting.pop(request_id, ()):
            self._aborted.append(self._output(item, "abort"))
        self.open.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self._aborted)

    def free_capacity(self) -> int:
        return max(0, self.config.max_num_seqs - len(self.waiting))

    def stats(self) -> dict:
        return {"num_running": 0, "num_waiting": sum(map(len, self.waiting.values())), "kv_usage": 0.0,
                "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0}

    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        batch = self._take()
        if not batch:
            return outputs
        try:
            answers = self._run(batch)
        except Exception as exc:  # the batched forward pass: no one request to blame
            return outputs + self._fail_step(batch, exc)
        for item, answer in zip(batch, answers):
            outputs.append(self._output(item, "stop", answer))
            self.open[item.request_id] -= 1
            if not self.open[item.request_id]:
                del self.open[item.request_id]
        return outputs

    def _fail_step(self, batch: list[_Input], exc: Exception) -> list[RequestOutput]:
        """End every request of the failed step, each with one retryable error output."""
        failed = {item.request_id: item for item in reversed(batch)}  # each request's first input
        error = step_error(exc, len(failed))
        for rid in failed:
            self.waiting.pop(rid, None)
            self.open.pop(rid, None)
        return [self._output(item, "error", error=error) for item in failed.values()]

    def _take(self) -> list[_Input]:
        """Inputs from each waiting request in turn while the batch, padded to its longest, fits
        the step's budget (at least one)."""
        batch, longest = [], 0
        while self.waiting:
            progressed = False
            for rid in list(self.waiting):
                queue = self.waiting[rid]
                size = max(longest, len(queue[0].ids)) * (len(batch) + 1)
                if batch and size > self.budget:
                    return batch
                item = queue.popleft()
                batch.append(item)
                longest, progressed = max(longest, len(item.ids)), True
                if not queue:
                    del self.waiting[rid]
            if not progressed:
                break
        return batch

    @torch.inference_mode()
    def _run(self, batch: list[_Input]) -> list[bytes]:
        """Each input's answer as little-endian float32 bytes."""
        cfg, longest = self.encoder_config, max(len(item.ids) for item in batch)
        ids = torch.full((len(batch), longest), cfg.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.bool)
        types = torch.zeros((len(batch), longest), dtype=torch.long)
        sep = getattr(self.tokenizer, "sep_token_id", None)
        for row, item in enumerate(batch):
            ids[row, :len(item.ids)] = torch.tensor(item.ids)
            mask[row, :len(item.ids)] = True
            if item.scored and cfg.type_vocab_size > 1 and sep in item.ids:  # the second segment: type 1
                types[row, item.ids.index(sep) + 1:len(item.ids)] = 1
        hidden = self.model(ids.to(self.device), mask.to(self.device), types.to(self.device))
        if batch[0].scored:  # (a worker serves one task: a batch is all pairs or all inputs)
            scores = torch.sigmoid(self.model.classify(hidden).float()[:, 0]).cpu()
            return [scores[row:row + 1].numpy().astype("<f4").tobytes() for row in range(len(batch))]
        pooled = self._pool(hidden.float(), mask.to(self.device)).cpu()
        answers = []
        for row, item in enumerate(batch):
            v = pooled[row, :item.length]
            if self.pooling.normalize:
                v = torch.nn.functional.normalize(v, p=2.0, dim=0)
            answers.append(v.numpy().astype("<f4").tobytes())
        return answers

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        mode = self.pooling.mode
        if mode == "cls":
            return hidden[:, 0]
        if mode == "mean":
            weights = mask.unsqueeze(-1).float()
            return (hidden * weights).sum(dim=1) / weights.sum(dim=1)
        last = mask.sum(dim=1) - 1  # "last": each input's own last token
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]

    @staticmethod
    def _output(item: _Input, reason: str, answer: bytes | None = None, error=None) -> RequestOutput:
        return RequestOutput(request_id=item.request_id, index=item.index, new_token_ids=[], text="", finished=True,
                             finish_reason=reason, num_prompt_tokens=len(item.ids), embedding=answer, error=error)

