"""Offline batch API: `LLM(model_dir).generate(prompts, params)` runs everything to completion;
`LLM(embedding_model_dir).embed(inputs)` gives each input's vector (vLLM's `LLM.embed`)."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from pathlib import Path

from worker.engine.engine import LLMEngine
from worker.engine.tokenizer import encode_pair, encode_prompt
from worker.engine.types import SamplingParams, TokenLogprob
from worker.models.pooling import is_encoder_folder


@dataclass
class Completion:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    outputs: list[Completion]  # one per choice (n)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token, when asked for

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class LLM:
    """`LLM(model_dir, tensor_parallel_size=2)` shards the model across two processes; close() (or a
    `with` block) stops them."""

    def __init__(self, model_dir: str | Path, **config_overrides):
        if is_encoder_folder(model_dir):  # a BERT-style folder: embeddings and scores only
            from worker.engine.encoder import EncoderEngine

            self.engine = EncoderEngine.from_model_dir(model_dir, **config_overrides)
        else:
            self.engine = LLMEngine.from_model_dir(model_dir, **config_overrides)

    def close(self) -> None:
        getattr(self.engine, "close", lambda: None)()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationResult]:
        """All prompts are submitted at once (continuous batching); results come back in prompt order."""
        params = params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        results = {}
        texts: dict[tuple[str, int], list[str]] = {}  # joined once: `+=` per token is quadratic
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            ids = encode_prompt(self.engine.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
            results[str(i)] = GenerationResult(ids, [Completion(j) for j in range(p.n)])
            self.engine.add_request(str(i), ids, p)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                choice = results[out.request_id].outputs[out.index]
                choice.token_ids += out.new_token_ids
                texts.setdefault((out.request_id, out.index), []).append(out.text)
                if out.prompt_logprobs is not None:
                    results[out.request_id].prompt_logprobs = out.prompt_logprobs
                if out.logprobs is not None:
                    if choice.logprobs is None:
                        choice.logprobs = []
                    choice.logprobs.extend(out.logprobs)
                if out.finished:
                    choice.finish_reason = out.finish_reason
        for (request_id, index), pieces in texts.items():
            results[request_id].outputs[index].text = "".join(pieces)
        return [results[str(i)] for i in range(len(prompts))]

    def embed(self, inputs: list[str] | list[list[int]], dimensions: int | None = None) -> list[list[float]]:
        """Each input's vector, in order, as one request (worker/engine/pooling.py); raises what the
        request failed with."""
        ids = [encode_prompt(self.engine.tokenizer, x) if isinstance(x, str) else list(x) for x in inputs]
        self.engine.add_embedding("embed", ids, SamplingParams(max_tokens=1), dimensions)
        return self._pooled(len(inputs))

    def _pooled(self, count: int) -> list[list[float]]:
        vectors: dict[int, list[float]] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.error is not None:
                    raise RuntimeError(f"{out.error.code}: {out.error.message}")
                vectors[out.index] = array("f", out.embedding).tolist()
        return [vectors[i] for i in range(count)]

    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        """A reranker's score of each (query, document) pair, in order, as one request
        (worker/models/pooling.py); raises what the request failed with."""
        ids = [encode_pair(self.engine.tokenizer, q, d, self.engine.score_template) for q, d in pairs]
        self.engine.add_scoring("score", ids, SamplingParams(max_tokens=1))
        return [v[0] for v in self._pooled(len(pairs))]
