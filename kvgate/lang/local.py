"""The in-process engine as a backend (tests, offline jobs): one thread steps an LLMEngine and every
program state's calls join its batch, so forks and batches run concurrently as they do on a worker.
Same semantics as a gateway's: the same tokenization of a completion prompt, the same defaults (no
max_tokens: the rest of the context), the same select scoring (prompt_logprobs after the state)."""
from __future__ import annotations

import itertools
import json
import queue
import threading
from collections.abc import Callable
from pathlib import Path

from kvgate.lang.backends import Backend, BackendError, Generated
from worker.engine.chat_markers import chat_markers
from worker.engine.llm import LLM
from worker.engine.tokenizer import encode_prompt
from worker.engine.types import EngineRejected, SamplingParams
from worker.model_defaults import read_model_defaults
from shared.sampling import StructuredOutputs

IDLE_WAIT_S = 0.05


class _Call:
    """One request in flight: its text so far, its prompt scores, and who waits for it."""

    def __init__(self, on_text: Callable[[str], None] | None):
        self.on_text, self.text, self.done = on_text, [], threading.Event()
        self.reason = self.error = self.prompt_logprobs = None
        self.prompt_tokens = self.completion_tokens = 0


class Local(Backend):
    """`Local(LLM(model_dir))` or `Local(model_dir, **engine settings)`; close() stops its thread
    (and the LLM, when it made it)."""

    def __init__(self, llm: LLM | str | Path, **config):
        self._owns = not isinstance(llm, LLM)
        self.llm = LLM(llm, **config) if self._owns else llm
        self.engine = self.llm.engine
        self._markers = chat_markers(self.engine.tokenizer)
        # what a gateway's worker defaults a left-out sampling field to, so both backends sample alike
        self._defaults = read_model_defaults(self.engine.config.model_dir)
        self._inbox: queue.Queue = queue.Queue()
        self._calls: dict[str, _Call] = {}
        self._ids = itertools.count()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="kvgate-lang-engine")
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._thread.join()
        if self._owns:
            self.llm.close()

    def markers(self) -> dict | None:
        return self._markers

    def tokenize(self, text: str) -> list[int]:
        return encode_prompt(self.engine.tokenizer, text)

    def generate(self, prompt: str, params: dict, on_text: Callable[[str], None] | None = None) -> Generated:
        ids = self.tokenize(prompt)
        call = self._wait(self._submit(ids, self._params(params, len(ids)), on_text))
        return Generated("".join(call.text), call.reason, call.prompt_tokens, call.completion_tokens)

    def score(self, prompt: str, choices: list[str]) -> list[float]:
        """All choices in one submission; each scores only the positions after the state."""
        from kvgate.lang.backends import mean_logprob

        start = len(self.tokenize(prompt))
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, prompt_logprobs_start=start)
        calls = [self._submit(self.tokenize(prompt + c), params, None) for c in choices]
        scores = []
        for call in calls:
            entries = [None if e is None else {e.token_id: {"logprob": e.logprob}} for e in self._wait(call).prompt_logprobs]
            scores.append(mean_logprob(entries, start, call.prompt_tokens))
        return scores

    def _params(self, params: dict, prompt_len: int) -> SamplingParams:
        fields = self._defaults | {k: v for k, v in params.items() if k != "structured_outputs"}
        fields.setdefault("max_tokens", max(1, self.engine.max_model_len - prompt_len))
        spec = params.get("structured_outputs")
        if spec:
            schema = spec.get("json")
            fields["structured_outputs"] = StructuredOutputs(
                json=json.dumps(schema) if isinstance(schema, dict) else schema,
                regex=spec.get("regex"), choice=spec.get("choice"))
        return SamplingParams(**fields)

    def _submit(self, ids: list[int], params: SamplingParams, on_text) -> _Call:
        call = _Call(on_text)
        self._inbox.put((f"lang-{next(self._ids)}", ids, params, call))
        return call

    @staticmethod
    def _wait(call: _Call) -> _Call:
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call

    def _loop(self) -> None:
        while not self._closed.is_set():
            self._admit(block=not self.engine.has_unfinished())
            if self.engine.has_unfinished():
                for out in self.engine.step():
                    self._on_output(out)

    def _admit(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            rid, ids, params, call = item
            try:
                self.engine.add_request(rid, ids, params)
                self._calls[rid] = call
            except EngineRejected as exc:
                call.error = BackendError(str(exc), 400, exc.code)
                call.done.set()
            except ValueError as exc:
                call.error = BackendError(str(exc), 400, "invalid_request")
                call.done.set()
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None

    def _on_output(self, out) -> None:
        call = self._calls.get(out.request_id)
        if call is None:
            return
        if out.error is not None:
            call.error = BackendError(out.error.message, None, out.error.code)
        if out.text:
            call.text.append(out.text)
            if call.on_text is not None:
                call.on_text(out.text)
        if out.prompt_logprobs is not None:
            call.prompt_logprobs = out.prompt_logprobs
        call.prompt_tokens, call.completion_tokens = out.num_prompt_tokens, out.num_output_tokens
        if out.finished or out.error is not None:
            call.reason = out.finish_reason
            call.done.set()
            del self._calls[out.request_id]
