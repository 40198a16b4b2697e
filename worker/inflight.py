"""The requests in flight on this worker. Every engine output goes out as a reply to its request (a
delta with the request's next sequence number, in its entry's schema), and each request ends here
exactly once — done, failed, cancelled or timed out — with its entry acknowledged and its metrics
closed. One output that raises ends its own request, never the loop.
"""
from __future__ import annotations

import base64
import logging
import math
import time
from dataclasses import dataclass, field
from functools import cached_property

from shared import errors, protocol
from shared.redis_errors import REDIS_ERRORS
from worker.engine.types import RequestError, RequestOutput
from worker.held import Held
from worker.metrics import WorkerMetrics
from worker.outcomes import FAILED
from worker.replies import Outbox
from worker.thinking import ThinkingSplit
from worker.token_text import TokenText

log = logging.getLogger("kvgate.worker")


@dataclass
class Active:
    """What the worker remembers about one admitted request."""

    entry_id: bytes
    reply_channel: str
    n: int
    prompt_tokens: int = 0
    seq: int = 0
    completion_tokens: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    stream: str | None = None  # the stream the entry came from; None: the interactive lane
    version: int = protocol.SCHEMA_VERSION  # the entry's schema: its replies are written in it
    deadline: float = math.inf  # the entry's, in time.time(): enforced here while Redis refuses
    splits: dict[int, ThinkingSplit] | None = None  # choice → its thinking/answer split (reasoning models)
    streamed: bool = True  # False: its replies may be held (worker/held.py)
    sent_token: bool = False  # a delta with tokens went out
    held: Held | None = None
    prompt_texts: list[str] | None = None  # go out on the verdict (an entry's echo_prompt)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def split(self, out: RequestOutput) -> tuple[str | None, str]:
        """(thinking, answer) of the text `out` released; all of it is the answer without a split."""
        split = self.splits.get(out.index) if self.splits else None
        if split is None:
            return None, out.text
        return split.add(out.new_token_ids, out.text, final=out.finished)


class InFlight:
    def __init__(self, engine, outbox: Outbox, metrics: WorkerMetrics, tokenizer, hold_s: float = 1.0,
                 first_hold_s: float = 0.02):
        """`hold_s`: KVGATE_HOLD_S, how long a whole answer's deltas may be held (0: never);
        `first_hold_s`: KVGATE_FIRST_HOLD_S, how long its verdict and first token may be."""
        self.engine, self.outbox, self.metrics, self.tokenizer = engine, outbox, metrics, tokenizer
        self.hold_s, self.first_hold_s = hold_s, min(hold_s, first_hold_s)
        self.requests: dict[str, Active] = {}
        self.holding: set[str] = set()  # the requests with deltas held

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def entry_ids(self) -> set[bytes]:
        return {act.entry_id for act in self.requests.values()}

    def add(self, request_id: str, act: Active) -> Active:
        self.requests[request_id] = act
        return act

    def collect(self, outputs: list[RequestOutput]) -> None:
        """Each output on its own: one that raises ends its request, never the loop."""
        for out in outputs:
            try:
                self._collect_one(out)
            except REDIS_ERRORS:
                raise
            except Exception as exc:
                log.error("request %s failed while its output was sent (%s)", out.request_id,
                          type(exc).__name__, exc_info=exc, extra={"request_id": out.request_id})
                self.fail(out.request_id, RequestError(
                    errors.RequestFailed.code, f"the worker failed on this request's output "
                    f"({type(exc).__name__}); it was ended alone"))

    def _collect_one(self, out: RequestOutput) -> None:
        act = self.requests.get(out.request_id)
        if act is None:  # aborted meanwhile
            return
        if out.error is not None:
            self.fail(out.request_id, out.error)
            return
        act.completion_tokens[out.index] = out.num_output_tokens
        self.metrics.output(out)
        reasoning, text = act.split(out)
        finish = out.finish_reason if out.finished else None
        if act.streamed or not self.hold_s:
            act.sent_token = act.sent_token or bool(out.new_token_ids)
            self._send(act, protocol.Delta(
                request_id=out.request_id, seq=0, index=out.index, text=text, reasoning=reasoning or None,
                token_ids=out.new_token_ids, logprobs=self._wire_logprobs(out),
                prompt_logprobs=self._wire_prompt_logprobs(out), finish_reason=finish,
                embedding=None if out.embedding is None else base64.b64encode(out.embedding).decode()))
        else:
            self._held(out.request_id, act).choice(out.index).add(
                text, reasoning, out.new_token_ids, self._wire_logprobs(out), self._wire_prompt_logprobs(out),
                finish)
            if out.finished:
                self._release(out.request_id, act, out.index)
        if out.finished:
            act.finished.add(out.index)
            if len(act.finished) == act.n:
                self._done(out.request_id)

    def _send(self, act: Active, delta: protocol.Delta) -> None:
        delta.seq = act.next_seq()
        self.outbox.reply(act.reply_channel, delta, act.version)

    def _held(self, request_id: str, act: Active) -> Held:
        if act.held is None:
            act.held = Held()
            self.holding.add(request_id)
        return act.held

    def verdict(self, request_id: str, act: Active) -> None:
        """The admission verdict: a stream's goes out now, a whole answer's with its first token
        (worker/held.py), unless KVGATE_FIRST_HOLD_S is 0."""
        if act.streamed or not self.first_hold_s:
            self._send(act, self._verdict(request_id, act))
        else:
            self._held(request_id, act).verdict = True

    @staticmethod
    def _verdict(request_id: str, act: Active) -> protocol.Delta:
        texts, act.prompt_texts = act.prompt_texts, None  # (a verdict goes out once: kept no longer)
        return protocol.Delta(request_id=request_id, seq=0, prompt_texts=texts)

    def _release(self, request_id: str, act: Active, index: int | None = None) -> None:
        """Send what `act` holds of choice `index` (None: of every choice) as one delta each, after
        the verdict if it waits."""
        if act.held is None:
            return
        if act.held.verdict:
            act.held.verdict = False
            self._send(act, self._verdict(request_id, act))
        for i, choice in act.held.take(index):
            act.sent_token = act.sent_token or bool(choice.token_ids)
            self._send(act, choice.delta(request_id, 0, i))
        if not act.held.choices:
            act.held = None
            self.holding.discard(request_id)

    def release_due(self) -> None:
        """Send the deltas held for `hold_s` or longer, a verdict and first token held for
        `first_hold_s` (once a step)."""
        if self.holding:
            now = time.monotonic()
            for rid in [rid for rid in self.holding if self.requests[rid].held.due(
                    now, self.hold_s if self.requests[rid].sent_token else self.first_hold_s)]:
                self._release(rid, self.requests[rid])

    def _pop(self, request_id: str, release: bool = True) -> Active | None:
        """`request_id` leaves the requests in flight, what it held sent first (`release`) or dropped."""
        act = self.requests.pop(request_id, None)
        if act is not None and release:
            self._release(request_id, act)
        self.holding.discard(request_id)
        return act

    @cached_property
    def _token_text(self) -> TokenText:
        return TokenText(self.tokenizer)

    def _wire_logprobs(self, out: RequestOutput) -> list[dict] | None:
        """Per token: its text, real bytes and logprob, and every top entry's, in rank order.
        `top` stays [text, logprob] pairs, as a gateway of the previous release reads them."""
        if not out.logprobs:
            return None
        return [self._wire_logprob(lp) for lp in out.logprobs]

    def _wire_prompt_logprobs(self, out: RequestOutput) -> list[dict | None] | None:
        """One per prompt token, each with its rank; an unscored one (the first always) has only its
        token, logprob None (an echoed prompt still shows it)."""
        if out.prompt_logprobs is None:
            return None
        of = self._token_text.of
        return [{"token_id": t, "token": of(t)[0], "bytes": of(t)[1], "logprob": None} if lp is None
                else {**self._wire_logprob(lp), "rank": lp.rank}
                for t, lp in zip(out.prompt_token_ids, out.prompt_logprobs)]

    def _wire_logprob(self, lp) -> dict:
        of = self._token_text.of
        text, raw = of(lp.token_id)
        ids, values = zip(*lp.top) if lp.top else ((), ())
        tops = list(map(of, ids))  # each top token looked up once (a prompt's scores: 20 each)
        return {"token_id": lp.token_id, "token": text, "logprob": lp.logprob, "bytes": raw,
                "top": [[top[0], v] for top, v in zip(tops, values)], "top_ids": list(ids),
                "top_bytes": [top[1] for top in tops]}

    def _done(self, request_id: str) -> None:
        act = self._pop(request_id)
        self.outbox.reply(act.reply_channel, protocol.Done(
            request_id=request_id, seq=act.next_seq(), prompt_tokens=act.prompt_tokens,
            completion_tokens=sum(act.completion_tokens.values())), act.version)
        self.outbox.finish(act.entry_id, request_id, act.stream)
        self.metrics.finished(request_id)

    def fail(self, request_id: str, error: RequestError) -> None:
        """An admitted request failed: the engine lets it go, its client gets the error."""
        act = self._pop(request_id)
        if act is None:
            return
        try:
            self.engine.abort(request_id)  # its other choices, when the failure was not the engine's own
        except Exception as exc:
            log.error("abort of failed request %s raised (%s)", request_id, type(exc).__name__,
                      exc_info=exc)
        self.outbox.error(act.reply_channel, request_id, act.next_seq(), act.version, error.code,
                          error.message, error.param)
        self.outbox.finish(act.entry_id, request_id, act.stream)
        self.metrics.rejected(request_id, error.code, when=FAILED)

    def cancel(self, request_id: str) -> None:
        """Aborted in the engine at once, so its blocks are free for the next step; no reply (the
        client is gone)."""
        act = self._pop(request_id, release=False)
        if act is None:
            return
        self.engine.abort(request_id)
        self.outbox.finish(act.entry_id, request_id, act.stream)
        self.metrics.finished(request_id, "abort")
        log.info("aborted %s on cancel", request_id, extra={"request_id": request_id})

    def expire(self) -> None:
        """End the requests whose deadline passed; called while Redis refuses writes, when no step
        runs (their answers queue behind the held replies)."""
        now = time.time()
        for rid in [rid for rid, act in self.requests.items() if now > act.deadline]:
            act = self._pop(rid)
            self.engine.abort(rid)
            self.outbox.error(act.reply_channel, rid, act.next_seq(), act.version, "timeout",
                              "request deadline passed while Redis refused writes")
            self.outbox.finish(act.entry_id, rid, act.stream)
            self.metrics.finished(rid, "abort")
            log.info("timed out %s while Redis refused writes", rid, extra={"request_id": rid})
