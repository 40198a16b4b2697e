"""Admission: one stream entry into the engine, or answered with an error; never dropped in silence,
never left pending. It reads top to bottom, one function per hop: decode the entry → settle one
that needs no run (cancelled before it started; finished by a worker that died after its last
reply) → refuse it (the poison cap, an unresumable log, a passed deadline, an injected fault) or add
it to the engine (an entry over INLINE_BYTES first has its prompt made off the loop: `admit`
returns it `Waiting`, the prompt thread makes it, `resume` adds it). A request that fails, fails alone: nothing the entry carries may raise out of
here (an undecodable body, a schema version this worker does not read, an out-of-range number, a
template that raises). A Redis error may: the entry then waits in the consumer's backlog.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import orjson
import redis
from pydantic import ValidationError

from shared import errors, names, protocol
from shared.redis_errors import REDIS_ERRORS
from shared.settings import WorkerSettings
from worker import checkpoint, tokenizer_kinds
from worker.cancels import HeardCancels, added_at
from worker.consumer import PendingEntry
from worker.engine.base import prompts_of
from worker.engine.types import EngineRejected, Resume, SamplingParams
from worker.faults import Faults
from worker.inflight import Active, InFlight
from worker.metrics import WorkerMetrics
from worker.model_defaults import read_model_defaults, said
from worker.outcomes import ANSWERED, REJECTED
from worker.replies import Outbox
from worker.thinking import Markers, ThinkingSplit

log = logging.getLogger("kvgate.worker")

INLINE_BYTES = 8 << 10  # an entry this small has its prompt made on the loop (~4 ms at most)


@dataclass
class Waiting:
    """An admitted entry whose prompt (or tokenizer answer) is being made off the serving loop:
    `work` makes it, `then` admits the entry with it."""
    pending: PendingEntry
    entry: protocol.RequestEntry
    ckpt: checkpoint.Checkpoint
    work: Callable
    then: Callable


def short(p: PendingEntry) -> bool:
    """An entry this small has its prompt made on the serving loop, at admission."""
    return len(p.raw) <= INLINE_BYTES


def _renders_short(entry: protocol.RequestEntry) -> bool:
    """A score entry's pairs name their texts: what they render all together is what it costs (a
    short entry may render a long query once a document; it is made off the loop too)."""
    return entry.pairs is None or sum(len(entry.texts[q]) + len(entry.texts[d]) for q, d in entry.pairs) <= INLINE_BYTES


def to_sampling_params(entry: protocol.RequestEntry, default_max_tokens: int,
                       model_defaults: dict | None = None) -> SamplingParams:
    """Engine parameters from the wire; no max_tokens means as many as the context leaves, and a
    sampling field the client left out the model folder's default (worker/model_defaults.py)."""
    return entry.sampling_params(model_defaults, max_tokens=max(1, default_max_tokens))


class Admission:
    def __init__(self, s: WorkerSettings, client: redis.Redis, engine, tokenizer, outbox: Outbox,
                 metrics: WorkerMetrics, inflight: InFlight, markers: Markers | None = None,
                 heard: HeardCancels | None = None):
        """`markers`: the reasoning parser's, when the model thinks (its chats' text is split).
        `heard`: the cancels the serving loop heard (None: every admission reads the marker)."""
        self.s, self.client, self.engine, self.tokenizer = s, client, engine, tokenizer
        self.markers, self.heard = markers, heard
        self.outbox, self.metrics, self.inflight = outbox, metrics, inflight
        self.model_defaults = read_model_defaults(s.model) if s.generation_config == "auto" else {}
        if self.model_defaults:
            log.info("sampling defaults from the model's generation_config.json, for requests that leave "
                     "them out: %s (KVGATE_GENERATION_CONFIG=none: OpenAI's)", said(self.model_defaults))
        self.faults = Faults(s.fault_error_rate, s.fault_latency_ms, s.fault_crash_marker,
                             s.fault_step_ms)

    def admit(self, p: PendingEntry) -> Waiting | None:
        """None once it is admitted or answered; a `Waiting` when its prompt is long and is to be
        made off the serving loop (worker/prompt_thread.py), then `resume`d."""
        entry = self._decode(p)
        if entry is None or self._cancelled(p, entry):
            return None
        rid = entry.request_id
        ckpt = checkpoint.load(self.client, rid) if p.times_delivered else checkpoint.Checkpoint()
        if ckpt.done:  # its worker died after the last reply: nothing left to do
            self.outbox.finish(p.entry_id, rid, p.stream)
            return None
        if refusal := self._refusal(entry, ckpt, p.times_delivered):
            self._fail(p, entry, ckpt, *refusal)
            return None
        if entry.kind in protocol.TOKENIZER_KINDS:  # /tokenize, /detokenize: the engine never sees it
            then, work = self._answer_from_tokenizer, partial(
                tokenizer_kinds.answer, self.tokenizer, entry, ckpt.last_seq + 1, self.engine.max_model_len)
        else:
            self.faults.delay()
            then, work = self._add, partial(self._prompt, entry, ckpt.empty)
        # made off the loop when long: what is tokenized, and token ids an echo decodes back to text
        long = not (short(p) and _renders_short(entry))
        if long and (entry.kind in protocol.TOKENIZER_KINDS or entry.prompt_token_ids is None or entry.echo_prompt):
            return Waiting(p, entry, ckpt, work, then)
        then(p, entry, ckpt, work)
        return None

    def resume(self, waiting: Waiting, made: Callable) -> None:
        """A long prompt made off the loop (`made()`: its result, or raises what making it raised):
        admitted as any other, unless its cancel was heard meanwhile."""
        p, entry = waiting.pending, waiting.entry
        if self.heard is not None and entry.request_id in self.heard:
            self.outbox.ack(p.entry_id, p.stream)
            self.metrics.cancelled_unstarted()
            return
        waiting.then(p, entry, waiting.ckpt, made)

    def _decode(self, p: PendingEntry) -> protocol.RequestEntry | None:
        """The entry, or None once an entry that does not decode is answered (when it names whom
        to answer) and acknowledged."""
        try:
            return protocol.decode_entry(p.raw)
        except Exception as exc:  # bad JSON, a schema version we do not read, invalid fields
            problem = exc
        to = protocol.addressee(p.raw)
        if to is None or to[1] is None:
            log.warning("dropping an entry that names no reply channel %s: %s", p.entry_id, _why(problem))
            self.outbox.ack(p.entry_id, p.stream)
            return None
        rid, channel = to
        version = _schema_of(p.raw)
        if type(version) is int and protocol.OLDEST_SCHEMA <= version <= protocol.SCHEMA_VERSION:
            code, message = "invalid_request", f"the worker could not read this request: {_why(problem)}"
        else:  # answered in our own version: a newer gateway reads the version before the rest
            code = errors.UnsupportedSchema.code
            message = (f"the request is in schema version {version!r}; this worker reads versions "
                       f"{protocol.OLDEST_SCHEMA}..{protocol.SCHEMA_VERSION}")
            version = protocol.SCHEMA_VERSION
        seq = checkpoint.load(self.client, rid).last_seq + 1 if p.times_delivered else 1
        self.outbox.error(channel, rid, seq, version, code, message)
        self.outbox.finish(p.entry_id, rid, p.stream)
        self.metrics.rejected(rid, code)
        return None

    def _cancelled(self, p: PendingEntry, entry: protocol.RequestEntry) -> bool:
        """Cancelled before any worker started it: acknowledged, never run. A fresh entry's cancel
        was heard (worker/cancels.py) where the heard ids answer for it; otherwise the gateway's
        marker says."""
        if self.heard is not None and not p.times_delivered and self.heard.answers_for(added_at(p.entry_id)):
            cancelled = entry.request_id in self.heard
        else:
            cancelled = bool(self.client.exists(names.cancelled_key(entry.request_id)))
        if not cancelled:
            return False
        self.outbox.ack(p.entry_id, p.stream)
        self.metrics.cancelled_unstarted()
        return True

    def _refusal(self, entry: protocol.RequestEntry, ckpt: checkpoint.Checkpoint,
                 delivered: int) -> tuple[str, str] | None:
        """(code, message) when the entry must be answered instead of run."""
        if delivered >= self.s.max_deliveries:
            log.warning("request %s retired by the poison cap after %d deliveries", entry.request_id,
                        delivered, extra={"request_id": entry.request_id})
            return (errors.RequestFailedRepeatedly.code,
                    f"this request was handed to workers {delivered} times and never finished (each "
                    f"worker that took it stopped); it is not retried again (the cap is "
                    f"KVGATE_MAX_DELIVERIES={self.s.max_deliveries})")
        if not ckpt.resumable:
            why = "its checkpoint log was truncated at its size cap" if ckpt.truncated else \
                f"{ckpt.unreadable} lines of its checkpoint log are unreadable here"
            return (errors.ResumeFailed.code, f"this request's worker stopped and it cannot be resumed "
                    f"elsewhere: {why}; sending it again may succeed")
        if time.time() > entry.deadline:
            return "timeout", "request deadline passed before a worker started it"
        if self.faults.should_fail():
            return "engine_error", "injected fault (--fault-error-rate)"
        return None

    def _add(self, p: PendingEntry, entry: protocol.RequestEntry, ckpt: checkpoint.Checkpoint,
             prompt: Callable[[], tuple[list, list[str] | None]]) -> None:
        """Start it in the engine (`prompt()`: its prompt ids and echoed texts, `_prompt`); an input
        the engine refuses, or a bug its content reached, ends this request alone."""
        rid = entry.request_id
        try:
            self._start(p, entry, ckpt, prompt)
        except REDIS_ERRORS:
            raise
        except EngineRejected as exc:
            self._fail(p, entry, ckpt, exc.code, str(exc), exc.param, when=REJECTED)
        except ValueError as exc:  # before any compute: the tokenizer or a check refused the input
            self._fail(p, entry, ckpt, "invalid_request", str(exc), when=REJECTED)
        except Exception as exc:
            log.error("request %s failed at admission (%s)", rid, type(exc).__name__, exc_info=exc,
                      extra={"request_id": rid})
            if rid not in self.inflight:  # (a duplicate id would be the live request's)
                self.engine.abort(rid)
            self._fail(p, entry, ckpt, errors.RequestFailed.code,
                       f"the worker failed to start this request ({type(exc).__name__})")

    def _start(self, p: PendingEntry, entry: protocol.RequestEntry, ckpt: checkpoint.Checkpoint,
               prompt: Callable[[], tuple[list, list[str] | None]]) -> None:
        rid = entry.request_id
        prompt_ids, texts = prompt()
        prompts = prompts_of(prompt_ids)  # a batched completion's several
        self.faults.crash_if_marked(entry.prompt, entry.messages)
        if entry.kind in ("embed", "score"):
            self._pool(entry, prompts, ckpt, p.claim.tenant or None)
        else:
            self._generate(entry, prompt_ids, prompts, ckpt, p.claim.tenant or None)
        prompt_tokens = sum(map(len, prompts))
        self.outbox.logs.start(rid, ckpt.size)
        self.metrics.admitted(entry, prompt_tokens, resumed=p.times_delivered > 0)
        embeds = entry.kind in ("embed", "score")  # one vector (a pair's: one score) an input, each sent as made
        act = self.inflight.add(rid, Active(
            p.entry_id, entry.reply_channel, len(prompts) * (1 if embeds else entry.params.n), prompt_tokens,
            seq=ckpt.last_seq,
            finished=set(ckpt.finished), completion_tokens={i: len(t) for i, t in ckpt.tokens.items()},
            stream=p.stream, version=entry.v, deadline=entry.deadline,
            splits=self._splits(entry, prompt_ids, ckpt), streamed=entry.streamed or embeds,
            sent_token=any(ckpt.tokens.values()),
            prompt_texts=texts))
        if p.times_delivered:
            log.info("resumed %s after seq %d", rid, ckpt.last_seq, extra={"request_id": rid})
        if ckpt.empty:  # the admission verdict (last: nothing may fail after it), once per request
            self.inflight.verdict(rid, act)

    def _generate(self, entry: protocol.RequestEntry, prompt_ids: list, prompts: list[list[int]],
                  ckpt: checkpoint.Checkpoint, tenant: str | None) -> None:
        longest = max(map(len, prompts))
        room = self.engine.max_model_len - longest  # without max_tokens: what the longest prompt leaves
        if room < 1 and entry.params.max_tokens is None:  # the engine's words would name a max_tokens of 1
            raise EngineRejected(f"the prompt ({longest} tokens) leaves no room for a reply within "
                                 f"max_model_len of {self.engine.max_model_len} tokens (at least 1 token is "
                                 "generated; the request set no max_tokens)")
        params = to_sampling_params(entry, room, self.model_defaults)
        resume = Resume(output_ids=ckpt.tokens, finished=set(ckpt.finished))
        self.engine.add_request(entry.request_id, prompt_ids, params, resume, tenant=tenant,
                                to_context=entry.params.max_tokens is None)

    def _pool(self, entry: protocol.RequestEntry, prompts: list[list[int]], ckpt: checkpoint.Checkpoint,
              tenant: str | None) -> None:
        """An embeddings request (each input pooled by the paged engine of an embedding folder), or a
        scores one (each pair by a reranker's); a takeover skips the inputs whose answers went out."""
        scores = entry.kind == "score"
        add = getattr(self.engine, "add_scoring" if scores else "add_embedding", None)
        if add is None:
            raise EngineRejected(f"{'scores' if scores else 'embeddings'} need the paged engine; this worker runs "
                                 f"{type(self.engine).__name__}", "invalid_request", "model")
        params = SamplingParams(max_tokens=1, priority=entry.priority, cache_salt=entry.cache_salt)  # nothing sampled
        if scores:
            add(entry.request_id, prompts, params, set(ckpt.finished), tenant=tenant)
        else:
            add(entry.request_id, prompts, params, entry.dimensions, set(ckpt.finished), tenant=tenant)

    def _answer_from_tokenizer(self, p: PendingEntry, entry: protocol.RequestEntry,
                               ckpt: checkpoint.Checkpoint, answer: Callable) -> None:
        """Its answer (`answer()`), then done (the tokens counted as prompt, none generated),
        acknowledged at once; an input the tokenizer or template refuses fails alone, as at `_add`."""
        rid = entry.request_id
        try:
            delta, counted = answer()
        except EngineRejected as exc:
            self._fail(p, entry, ckpt, exc.code, str(exc), exc.param, when=REJECTED)
            return
        except Exception as exc:
            log.error("request %s failed in the tokenizer (%s)", rid, type(exc).__name__, exc_info=exc,
                      extra={"request_id": rid})
            self._fail(p, entry, ckpt, errors.RequestFailed.code,
                       f"the worker failed to {entry.kind} this request ({type(exc).__name__})")
            return
        self.outbox.reply(entry.reply_channel, delta, entry.v)
        self.outbox.reply(entry.reply_channel, protocol.Done(request_id=rid, seq=delta.seq + 1,
                                                             prompt_tokens=counted, completion_tokens=0), entry.v)
        self.outbox.finish(p.entry_id, rid, p.stream)

    def _prompt(self, entry: protocol.RequestEntry, first: bool) -> tuple[list, list[str] | None]:
        """The prompt's ids (a batch's: one list a prompt), and on its `first` delivery the texts its
        verdict echoes (`_prompt_texts`)."""
        ids = self._prompt_ids(entry)
        return ids, self._prompt_texts(entry, prompts_of(ids)) if first else None

    def _prompt_ids(self, entry: protocol.RequestEntry) -> list[int]:
        from worker.engine.tokenizer import encode_pair, encode_prompt, render_chat

        if entry.prompt_token_ids is not None:
            return list(entry.prompt_token_ids)
        if entry.pairs is not None:  # a reranker's (query, document) pairs, each rendered as its folder says
            texts, template = entry.texts or [], getattr(self.engine, "score_template", None)
            return [encode_pair(self.tokenizer, texts[q], texts[d], template) for q, d in entry.pairs]
        if entry.prompts is not None:  # a batched completion's, an embedding's inputs
            prompts = [list(p) if isinstance(p, list) else encode_prompt(self.tokenizer, p) for p in entry.prompts]
            if entry.truncate is None:
                return prompts
            keep = self.engine.max_model_len if entry.truncate == -1 else entry.truncate
            cut = getattr(self.engine, "truncate", None)  # an encoder's: its first tokens and its end
            return [cut(p, keep) if cut else p[-keep:] for p in prompts]  # a decoder's end kept, as vLLM truncates
        if entry.kind == "chat":
            return render_chat(self.tokenizer, entry.messages or [], entry.tools, entry.chat_template_kwargs)
        return encode_prompt(self.tokenizer, entry.prompt or "")

    def _prompt_texts(self, entry: protocol.RequestEntry, prompts: list[list[int]]) -> list[str] | None:
        """Token-id prompts as text, for a completion that echoes them (their special tokens kept, as
        the prompts hold them; the gateway asks only for those: text prompts it echoes itself)."""
        if not entry.echo_prompt:
            return None
        return [self.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]

    def _splits(self, entry: protocol.RequestEntry, prompt_ids: list[int],
                ckpt: checkpoint.Checkpoint) -> dict[int, ThinkingSplit] | None:
        """Each unfinished choice's thinking/answer split, from the prompt and the tokens it already
        sent; only chats have a place for reasoning (a completion's text stays whole)."""
        if self.markers is None or entry.kind != "chat":
            return None
        return {i: self.markers.split(prompt_ids, ckpt.tokens.get(i, []))
                for i in range(entry.params.n) if i not in ckpt.finished}

    def _fail(self, p: PendingEntry, entry: protocol.RequestEntry, ckpt: checkpoint.Checkpoint,
              code: str, message: str, param: str | None = None, when: str = ANSWERED) -> None:
        """Answer an entry that never ran here with an error, and retire it."""
        self.outbox.error(entry.reply_channel, entry.request_id, ckpt.last_seq + 1, entry.v, code,
                          message, param)
        self.outbox.finish(p.entry_id, entry.request_id, p.stream)
        self.metrics.rejected(entry.request_id, code, entry.trace, when)


def _schema_of(raw: bytes):
    """The `v` an entry carries, whatever JSON value it is (None: none, or not JSON)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return data.get("v") if isinstance(data, dict) else None


def _why(exc: Exception) -> str:
    """A short reason: pydantic's own text spans many lines and repeats the input."""
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'entry'}: {e['msg']}"
                         for e in exc.errors()[:3])
    return str(exc)
