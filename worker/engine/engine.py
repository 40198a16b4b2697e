"""The paged engine: scheduler + block pool + model runner behind the Engine protocol of types.py.

A request becomes n sequences (one per choice) that share the prompt's KV blocks through the
prefix cache; each step schedules, runs one forward pass, and turns sampled tokens into outputs.
"""
from __future__ import annotations

from pathlib import Path

from worker.engine.base import ModelFacts
from worker.engine.block_pool import BlockPool
from worker.engine.config import EngineConfig
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.model_runner import ModelRunner
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence
from worker.engine.stopping import check_finish, release_text
from worker.engine.tokenizer import eos_token_ids, load_tokenizer
from worker.engine.types import EngineRejected, RequestOutput, Resume, SamplingParams, TokenLogprob
from worker.models.loader import read_model_config


class LLMEngine(ModelFacts):
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = read_model_config(config.model_dir)
        tokenizer = load_tokenizer(config.model_dir)
        super().__init__(tokenizer, eos_token_ids(config.model_dir, tokenizer),
                         config.max_model_len or self.model_config.max_position_embeddings)
        self.runner = ModelRunner(config, self.model_config, self._eos_token_ids, self.max_model_len)
        self.pool = BlockPool(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.pool)
        self.requests: dict[str, list[Sequence]] = {}
        self._aborted: list[RequestOutput] = []  # reported on the next step

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, **overrides) -> LLMEngine:
        return cls(EngineConfig(model_dir=str(model_dir), **overrides))

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    resume: Resume | None = None) -> None:
        self._check_admission(prompt_ids, params)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        resume = resume or Resume()
        seqs = [Sequence(request_id, i, prompt_ids, params) for i in range(params.n)
                if i not in resume.finished]
        for seq in seqs:
            seq.detokenizer = IncrementalDetokenizer(
                self._tokenizer, seq.prompt_ids, params.stop, params.include_stop_str_in_output)
            for token in resume.output_ids.get(seq.index, []):  # one at a time, as first released
                seq.append_token(token)
                seq.detokenizer.add([token])
            self.scheduler.add(seq)
        self.requests[request_id] = seqs

    def _check_admission(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Reject what could never run, rather than let it wait forever."""
        total = self.check_context(prompt_ids, params)
        blocks = self.pool.blocks_for(total)
        if blocks > self.pool.num_blocks:
            raise EngineRejected(
                f"prompt + max_tokens = {total} tokens needs {blocks} KV blocks of {self.pool.block_size} "
                f"tokens, but the whole KV pool has {self.pool.num_blocks} blocks")

    def abort(self, request_id: str) -> None:
        """Blocks are freed now; each unfinished choice reports finish_reason "abort" next step."""
        for seq in self.requests.pop(request_id, []):
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                self._aborted.append(self._output(seq, [], "", None))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def free_capacity(self) -> int:
        """Sequence slots left, bounded by free blocks not already owed to waiting prompts."""
        waiting, running = self.scheduler.waiting, self.scheduler.running
        slots = self.config.max_num_seqs - len(running) - len(waiting)
        blocks = self.pool.num_free_blocks - sum(self.pool.blocks_for(s.num_tokens) for s in waiting)
        return max(0, min(slots, blocks))

    def stats(self) -> dict:
        return {
            "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
            "kv_usage": self.pool.usage, "prefix_cache_queries": self.pool.num_queries,
            "prefix_cache_hits": self.pool.num_hits, "num_preemptions": self.scheduler.num_preemptions,
            "num_free_blocks": self.pool.num_free_blocks, "num_blocks": self.pool.num_blocks,
        }

    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        sampled = self.runner.run(batch)
        for seq, num_new in batch:
            seq.num_computed_tokens += num_new
        outputs += [self._on_token(seq, token, logprob) for seq, token, logprob in sampled]
        return outputs

    def _on_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        seq.append_token(token)
        reason = check_finish(token, len(seq.output_ids), seq.params, self._eos_token_ids)
        text, reason = release_text(seq.detokenizer, token, reason, seq.params.include_stop_str_in_output)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            if all(s.is_finished for s in self.requests.get(seq.request_id, [])):
                self.requests.pop(seq.request_id, None)
        return self._output(seq, [token], text, logprob)

    @staticmethod
    def _output(seq: Sequence, new_ids: list[int], text: str, logprob: TokenLogprob | None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id, index=seq.index, new_token_ids=new_ids, text=text,
            finished=seq.is_finished, finish_reason=seq.finish_reason,
            logprobs=[logprob] if logprob is not None else None,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=len(seq.output_ids),
        )
