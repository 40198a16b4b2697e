"""The paged engine: scheduler + block pool + model runner behind the Engine protocol of types.py.

A request becomes n sequences (one per choice) that share the prompt's KV blocks through the
prefix cache; each step schedules, runs one forward pass, and turns sampled tokens into outputs.
A failure stays with its request: whatever raises for one sequence (sampling, stop check,
detokenizing) ends that request alone with an error output; a forward pass that raises cannot be
blamed on one request, so every request in that step ends with a retryable error and the rest of
the engine goes on.
A request with structured_outputs first waits for its grammar (compiling.py) outside the scheduler;
each of its choices then gets a matcher (constraint.py) whose bitmask the sampler applies and which
accepts every token the choice emits; a grammar that ends finishes the choice with "stop".
An embedding folder's engine embeds instead of generating (`add_embedding`, pooling.py): each input a
prefill-only sequence whose output is its vector; a reranker's scores (query, document) pairs
(`add_scoring`), each pair's output its one score.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Collection
from pathlib import Path

from worker.engine import pooling
from worker.engine.base import ModelFacts, log, prompt_params, prompts_of, request_error, step_error
from worker.engine.block_pool import BlockPool
from worker.engine.compiling import CompilingRequests
from worker.engine.config import EngineConfig
from worker.engine.constraint import Constraint, think_markers
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.model_runner import ModelRunner
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence, SequenceStatus
from worker.engine.stopping import check_finish, release_text
from worker.engine.structured import Grammars
from worker.engine.tokenizer import eos_token_ids, load_tokenizer
from worker.engine.types import EngineRejected, RequestError, RequestOutput, Resume, SamplingParams, TokenLogprob
from worker.models.config import read_model_config
from worker.models.pooling import read_pooling, read_score_template, score_head


IDLE_COMPILE_WAIT_S = 0.05  # an empty step waits this long for a grammar instead of spinning


class LLMEngine(ModelFacts):
    constrains = True
    scores_prompts = True

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = read_model_config(config.model_dir)
        score_tokens = tuple(token for token in config.score_tokens.split(",") if token)
        self.pooling = read_pooling(config.model_dir, config.task, score_tokens)  # None: it generates
        tokenizer = load_tokenizer(config.model_dir)
        self.score_head = (score_head(config.model_dir, self.pooling, tokenizer, self.model_config.hidden_size)
                           if self.pooling is not None and self.pooling.scores else None)
        # a reranker's pair template (vLLM's score template: a chat template over messages of roles
        # "query" and "document"); None: the tokenizer's own pair encoding
        self.score_template = read_score_template(config.score_template) if config.score_template else None
        eos_ids = eos_token_ids(config.model_dir, tokenizer)
        self.runner = ModelRunner(config, self.model_config, eos_ids)
        self.kv_cache = self.runner.kv  # max_model_len is its effective one: what the pool holds
        super().__init__(tokenizer, eos_ids, self.kv_cache.max_model_len, self.model_config.vocab_size)
        log.info(self.kv_cache.line(), extra={**self.kv_cache_fields(), "max_model_len": self.max_model_len})
        self.pool = BlockPool(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.pool)
        self.requests: dict[str, list[Sequence]] = {}
        self._aborted: list[RequestOutput] = []  # reported on the next step
        self.grammars = Grammars(tokenizer, self.vocab_size, eos_ids, config.structured_max_spec_bytes,
                                 int(config.structured_cache_mb * 2**20), config.structured_compile_timeout_s)
        self.compiling = CompilingRequests(config.structured_compile_timeout_s)
        self.think_markers = think_markers(config.reasoning_parser, tokenizer)
        self.embedding_queue: dict[str, deque[Sequence]] = {}  # a request's inputs not yet scheduled
        self.embedding_open: dict[str, int] = {}  # its inputs in the scheduler, unfinished

    @property
    def embeds(self) -> bool:
        """This engine pools (embeds, or scores pairs) and does not generate."""
        return self.pooling is not None

    @property
    def task(self) -> str:
        """What it serves: "generate", "embed" (/v1/embeddings) or "score" (/v1/score, /v1/rerank)."""
        return "generate" if self.pooling is None else "score" if self.pooling.scores else "embed"

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, **overrides) -> LLMEngine:
        return cls(EngineConfig(model_dir=str(model_dir), **overrides))

    def add_request(self, request_id: str, prompt_ids: list[int] | list[list[int]], params: SamplingParams,
                    resume: Resume | None = None, tenant: str | None = None, to_context: bool = False) -> None:
        """All or nothing: the sequences are built (and a resumed one's tokens replayed) before any
        enters the scheduler, so a request that raises here leaves no trace in the engine. `tenant`
        (the key the worker read from the entry) takes its turn for a grammar compile. `prompt_ids`:
        one prompt, or a batched completion's prompts, each with its n choices (base.prompts_of);
        `to_context`: the request set no max_tokens (base.prompt_params)."""
        # Nothing is reserved: blocks are allocated as the sequence grows, preemption handles
        # pressure, and start-up sized max_model_len to what the pool holds, so whatever passes
        # the context check (a request without max_tokens: the rest of the context) can run.
        if self.embeds:
            served = "/v1/score and /v1/rerank" if self.task == "score" else "/v1/embeddings"
            raise EngineRejected(f"this model is {'a reranker' if self.task == 'score' else 'an embedding model'}: "
                                 f"it serves {served}, not generation", "invalid_request", "model")
        self.check_request(prompt_ids, params, resume)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        spec = params.structured_outputs
        grammar = self.grammars.submit(spec, tenant) if spec is not None else None  # refuses an oversized spec
        resume = resume or Resume()
        seqs = [Sequence(request_id, p * params.n + i, prompt,
                         prompt_params(params, prompt, self.max_model_len, to_context))
                for p, prompt in enumerate(prompts_of(prompt_ids)) for i in range(params.n)
                if p * params.n + i not in resume.finished]
        for seq in seqs:
            seq.detokenizer = IncrementalDetokenizer(
                self._tokenizer, seq.prompt_ids, params.stop, params.include_stop_str_in_output, params.min_tokens)
            for token in resume.output_ids.get(seq.index, []):  # one at a time, as first released
                seq.append_token(token)
                seq.detokenizer.add([token])
            if seq.output_ids:  # a resumed choice: its prompt's scores went out with its first token
                seq.prompt_scores = None
        if grammar is not None and seqs:  # waits for its grammar outside the batch
            self.compiling.add(request_id, grammar, seqs)
        else:
            for seq in seqs:
                self.scheduler.add(seq)
        if seqs:  # a resumed request whose choices all finished has nothing left here
            self.requests[request_id] = seqs

    def add_embedding(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                      dimensions: int | None = None, finished: Collection[int] = (), tenant: str | None = None) -> None:
        """Embed each prompt (input i's vector is output index i; `dimensions`: a Matryoshka model's
        cut); `finished`: the inputs a worker that stopped already answered. All or nothing, as
        add_request; the inputs enter the scheduler AT_ONCE at a time (`_feed`)."""
        if self.task != "embed":
            raise EngineRejected(self._not_served("embeddings"), "invalid_request", "model")
        length = pooling.check(self.pooling, self.model_config.hidden_size, len(prompts), dimensions)
        embed = pooling.Embed(self.pooling.mode, length, self.pooling.normalize)
        self._add_pooled(request_id, prompts, params, embed, finished, "input", "input")

    def add_scoring(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                    finished: Collection[int] = (), tenant: str | None = None) -> None:
        """Score each rendered (query, document) pair (pair i's score is output index i: its
        `embedding`, one float32); otherwise as add_embedding."""
        if self.task != "score":
            raise EngineRejected(self._not_served("scores"), "invalid_request", "model")
        if not 1 <= len(prompts) <= pooling.MAX_INPUTS:
            raise EngineRejected(f"{len(prompts)} pairs; a request scores 1 to {pooling.MAX_INPUTS}", "invalid_request")
        embed = pooling.Embed("last", 1, False, self.score_head)
        self._add_pooled(request_id, prompts, params, embed, finished, "pair", None)

    def _not_served(self, what: str) -> str:
        served = {"generate": "generates text", "embed": "is an embedding model (/v1/embeddings)",
                  "score": "is a reranker (/v1/score, /v1/rerank)"}[self.task]
        by = {"embeddings": "an embedding model folder, or a worker started with --task embed",
              "scores": "a reranker's folder, or a worker started with --task score"}[what]
        return f"this model {served}; it does not serve {what} ({by} does)"

    def _add_pooled(self, request_id: str, prompts: list[list[int]], params: SamplingParams, embed: pooling.Embed,
                    finished: Collection[int], what: str, param: str | None) -> None:
        self.check_pooled_inputs(prompts, what, param)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        seqs = [Sequence(request_id, i, prompt, params) for i, prompt in enumerate(prompts) if i not in finished]
        for seq in seqs:
            seq.embed, seq.status = embed, SequenceStatus.QUEUED
        if seqs:
            self.requests[request_id] = seqs
            self.embedding_queue[request_id] = deque(seqs)
            self.embedding_open[request_id] = 0

    def _feed(self) -> None:
        """Each embedding request's next inputs into the scheduler, up to AT_ONCE of its own there."""
        for request_id, queue in list(self.embedding_queue.items()):
            while queue and self.embedding_open[request_id] < pooling.AT_ONCE:
                self.scheduler.add(queue.popleft())
                self.embedding_open[request_id] += 1
            if not queue:
                del self.embedding_queue[request_id]

    def _forget_embedding(self, request_id: str) -> None:
        self.embedding_queue.pop(request_id, None)
        self.embedding_open.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Blocks are freed now; each unfinished choice reports finish_reason "abort" next step."""
        self.compiling.remove(request_id)
        self._forget_embedding(request_id)
        for seq in self.requests.pop(request_id, []):
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                self._aborted.append(self._output(seq, [], "", None))

    def close(self) -> None:
        """Stop what the engine started beside itself (a tensor-parallel engine's other ranks)."""
        self.runner.close()

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self._aborted) or bool(self.compiling)
                or bool(self.embedding_queue))

    def free_capacity(self) -> int:
        """Sequence slots left, bounded by free blocks not already owed to waiting prompts; a
        sequence that just yielded its slot to the fair order holds none until the next step."""
        waiting, running = self.scheduler.waiting, self.scheduler.running
        slots = (self.config.max_num_seqs - len(running) - len(waiting) - self.compiling.num_seqs
                 + len(self.scheduler.yielded))
        blocks = self.pool.num_free_blocks - sum(self.pool.blocks_for(s.num_tokens) for s in waiting)
        return max(0, min(slots, blocks))

    def running_requests(self) -> list[str]:
        """The request id of each running sequence (a request with n choices appears n times)."""
        return [s.request_id for s in self.scheduler.running]

    def yield_slot(self, request_ids: Collection[str], priority: int) -> bool:
        """One running sequence of `request_ids` (priority no better than `priority`) gives its slot
        up and is recomputed later: the fair order's room for a tenant below its share."""
        return self.scheduler.yield_slot(request_ids, priority)

    def stats(self) -> dict:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting) + self.compiling.num_seqs
            + sum(map(len, self.embedding_queue.values())),
            "kv_usage": self.pool.usage, "prefix_cache_queries": self.pool.num_queries,
            "prefix_cache_hits": self.pool.num_hits, "num_preemptions": self.scheduler.num_preemptions,
            "num_fair_preemptions": self.scheduler.num_fair_preemptions,
            "num_free_blocks": self.pool.num_free_blocks, "num_blocks": self.pool.num_blocks,
        }

    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        outputs += self._start_compiled()
        self._feed()
        batch = self.scheduler.schedule()
        if not batch:
            self.compiling.wait(IDLE_COMPILE_WAIT_S)
            return outputs
        try:
            sampled = self.runner.run(batch)
        except Exception as exc:  # the batched forward pass: no one request to blame
            return outputs + self._fail_step(batch, exc)
        for seq, num_new in batch:
            seq.num_computed_tokens += num_new
        outputs += self._prefilled(batch)
        for seq, token, logprob in sampled:
            if seq.is_finished:  # its request failed earlier in this loop
                continue
            try:
                if isinstance(token, Exception):
                    raise token  # the sampler raised on this row alone
                outputs.append(self._on_token(seq, token, logprob))
            except Exception as exc:
                outputs.append(self._fail_request(seq, request_error(seq.request_id, exc)))
        return outputs

    def _prefilled(self, batch) -> list[RequestOutput]:
        """The prefill-only sequences whose prefill this step ended: finished, an embedding input
        with its vector, a max_tokens 0 choice ("length") with its prompt's scores."""
        outputs = []
        for seq, _ in batch:
            if not seq.prefill_only or seq.is_finished or seq.num_computed_tokens < seq.num_tokens:
                continue
            try:
                vector = pooling.vector(seq) if seq.embed is not None else None
            except Exception as exc:
                outputs.append(self._fail_request(seq, request_error(seq.request_id, exc)))
                continue
            rid = seq.request_id
            self.scheduler.finish(seq, "stop" if seq.embed is not None else "length")
            if seq.embed is not None:  # counted, not scanned: a request may have 2,048 inputs
                self.embedding_open[rid] -= 1
                done = not self.embedding_open[rid] and rid not in self.embedding_queue
            else:
                done = all(s.is_finished for s in self.requests.get(rid, []))
            if done:
                self.requests.pop(rid, None)
                self._forget_embedding(rid)
            out = self._output(seq, [], "", None)
            out.embedding = vector
            self._add_prompt_scores(out, seq)
            outputs.append(out)
        return outputs

    def _start_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar is ready enter the scheduler; a failed compile ends its request."""
        outputs = []
        for seqs, grammar in self.compiling.settled():
            error = grammar if isinstance(grammar, RequestError) else self._constrain(seqs, grammar)
            if error is not None:
                outputs.append(self._fail_request(seqs[0], error))
                continue
            for seq in seqs:
                self.scheduler.add(seq)
        return outputs

    def _constrain(self, seqs: list[Sequence], grammar) -> RequestError | None:
        """A matcher per choice, a resumed one fed the tokens it already emitted."""
        try:
            for seq in seqs:
                seq.constraint = Constraint(grammar, seq.prompt_ids, self.think_markers,
                                            self.config.structured_max_token_ms)
                if not seq.constraint.replay(seq.output_ids):
                    return RequestError("resume_failed", "the tokens this request already emitted do "
                                        "not match its structured_outputs grammar")
        except Exception as exc:
            return request_error(seqs[0].request_id, exc)
        return None

    def _fail_step(self, batch, exc: Exception) -> list[RequestOutput]:
        """End every request of the failed step with a retryable error and free its blocks. The
        step may have written some KV and not the rest, so the prefix cache forgets every hash
        rather than serve a block the step left half-written."""
        failed: dict[str, Sequence] = {}
        for seq, _ in batch:
            failed.setdefault(seq.request_id, seq)
        error = step_error(exc, len(failed))
        outputs = [self._fail_request(seq, error) for seq in failed.values()]
        self.pool.forget_cached()
        return outputs

    def _fail_request(self, seq: Sequence, error: RequestError) -> RequestOutput:
        """End all of `seq`'s request (every choice) with one error output; its blocks are free."""
        self._forget_embedding(seq.request_id)
        for other in self.requests.pop(seq.request_id, [seq]):
            if not other.is_finished:
                self.scheduler.finish(other, "error")
        seq.finish_reason = "error"
        out = self._output(seq, [], "", None)
        out.error = error
        return out

    def _on_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        seq.append_token(token)
        if seq.constraint is not None and not seq.constraint.accept(token):
            raise ValueError(f"the grammar refused sampled token {token}")  # the mask forbade it
        reason = check_finish(token, len(seq.output_ids), seq.params, self._eos_token_ids)
        if seq.constraint is not None and seq.constraint.terminated:
            reason = "stop"  # the grammar ended (its stop token accepted)
        text, reason = release_text(seq.detokenizer, token, reason, seq.params.include_stop_str_in_output)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            if all(s.is_finished for s in self.requests.get(seq.request_id, [])):
                self.requests.pop(seq.request_id, None)
        out = self._output(seq, [token], text, logprob)
        self._add_prompt_scores(out, seq)
        return out

    @staticmethod
    def _add_prompt_scores(out: RequestOutput, seq: Sequence) -> None:
        """The prompt's scores go out once, with the choice's first output."""
        out.prompt_logprobs = seq.take_prompt_logprobs()
        if out.prompt_logprobs is not None:
            out.prompt_token_ids = seq.prompt_ids

    @staticmethod
    def _output(seq: Sequence, new_ids: list[int], text: str, logprob: TokenLogprob | None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id, index=seq.index, new_token_ids=new_ids, text=text,
            finished=seq.is_finished, finish_reason=seq.finish_reason,
            logprobs=[logprob] if logprob is not None else None,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=len(seq.output_ids),
        )


