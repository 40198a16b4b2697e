"""The worker service: pulls request entries from its Redis stream (and orphans of dead workers),
runs them on an engine, and publishes every delta to the entry's reply channel, with a checkpoint
log that lets another worker resume the request. The engine knows nothing of Redis; this does.

A request that fails, fails alone: whatever one entry carries (an undecodable body, a schema version
this worker does not read, an out-of-range number, a template that raises, a crash in its sampling)
ends that request with an error reply on its channel, in its entry's schema version, and the worker
goes on. An entry that workers keep taking and never finishing is retired by the poison cap.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from functools import cached_property

import orjson
import redis
from pydantic import ValidationError

from shared import errors, names, protocol
from shared.backoff import Backoff
from shared.redis_errors import refusal
from shared.settings import WorkerSettings
from worker import checkpoint
from worker.engine.types import EngineRejected, RequestError, RequestOutput, Resume, SamplingParams
from worker.faults import Faults
from worker.metrics import WorkerMetrics
from worker.replies import Outbox
from worker.takeover import claim_orphans
from worker.token_text import TokenText

log = logging.getLogger("kvgate.worker")
RETRYABLE = {errors.EngineStepFailed.code, errors.ResumeFailed.code}  # sent again, may succeed


@dataclass
class Active:
    """What the service remembers about one admitted request."""

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

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq


def _entries(reply) -> list[tuple[str, bytes, bytes, int]]:
    """(stream, entry id, raw entry, times delivered before=0: not claimed) of an XREADGROUP reply."""
    return [(name.decode() if isinstance(name, bytes) else name, entry_id,
             fields.get(protocol.ENTRY_FIELD, b""), 0)
            for name, entries in reply or [] for entry_id, fields in entries]


def to_sampling_params(entry: protocol.RequestEntry, default_max_tokens: int) -> SamplingParams:
    """Engine parameters from the wire; no max_tokens means as many as the context leaves."""
    return entry.sampling_params(max_tokens=max(1, default_max_tokens))


class WorkerService:
    def __init__(self, settings: WorkerSettings, engine, tokenizer):
        self.s = settings
        self.engine = engine
        self.tokenizer = tokenizer
        self.redis = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=2,
                                          socket_timeout=10, health_check_interval=10)
        self.stream = names.request_stream(settings.served_name, settings.version)
        self.batch_stream = names.request_stream(settings.served_name, settings.version,
                                                 names.BATCH_LANE)
        self.outbox = Outbox(self.redis, self.stream, settings.worker_id, settings.max_checkpoint_bytes)
        self.active: dict[str, Active] = {}
        self.backlog: list[tuple[str, bytes, bytes, int]] = []  # read, not yet admitted (Redis blip)
        self.cancels: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.stopping = threading.Event()
        self.drain_deadline: float | None = None
        self.last_claim = 0.0
        self.interactive_drained = True  # the last read of the interactive lane left nothing
        self.backoff = Backoff(0.05, 2.0)  # between tries while Redis refuses or errs
        self.faults = Faults(settings.fault_error_rate, settings.fault_latency_ms,
                             settings.fault_crash_marker)
        self.counters = {"requests_admitted": 0, "requests_finished": 0, "requests_aborted": 0,
                         "requests_rejected": 0, "requests_resumed": 0, "requests_failed": 0,
                         "requests_poisoned": 0}
        self.metrics = WorkerMetrics(settings.served_name, settings.version, settings.worker_id,
                                     engine.stats)

    # -- lifecycle -------------------------------------------------------------------------
    def run(self) -> None:
        self._until_redis(self._ensure_group)
        self._until_redis(self._register_model)
        threads = [threading.Thread(target=self._heartbeat_loop, daemon=True, name="heartbeat"),
                   threading.Thread(target=self._cancel_loop, daemon=True, name="cancels")]
        for t in threads:
            t.start()
        log.info("worker %s serving %s:%s on %s", self.s.worker_id, self.s.served_name,
                 self.s.version, self.stream)
        try:
            while not self.stopping.is_set():
                try:
                    self._iteration()
                except redis.RedisError as exc:
                    self._on_redis_error(exc)
        finally:
            self._deregister()

    def _on_redis_error(self, exc: redis.RedisError) -> None:
        """No Redis error ends the worker: what was read and not admitted is in the backlog, what
        was not sent in the outbox; both go on when Redis answers again."""
        if "NOGROUP" in str(exc):  # Redis came back without our streams: make them again
            self._until_redis(self._ensure_group)
            return
        log.warning("Redis error, retrying: %s", refusal(exc) or exc)
        self.stopping.wait(self.backoff.next())

    def stop(self) -> None:
        self.stopping.set()

    def drain(self) -> None:
        """Stop pulling; finish in-flight requests within the grace period; leave the rest pending
        (and deregister) so live workers claim and resume them."""
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.s.drain_grace_s
            log.info("draining: %d requests in flight", len(self.active))
        if not self.active:  # nothing to finish: stop now, even while Redis is away
            self.stopping.set()

    def _iteration(self) -> None:
        self.outbox.flush()
        if self.outbox.held:  # Redis refuses: keep the replies, step no further
            self._while_refused()
            return
        self._apply_cancels()
        draining = self.drain_deadline is not None
        if draining:
            if not self.active or time.monotonic() > self.drain_deadline:
                self.stopping.set()
                return
        else:
            self._pull()
        if self.engine.has_unfinished():
            self._collect(self.engine.step())
        reads = [] if draining else self._next_reads()
        if (replies := self.outbox.flush(reads)) is not None:  # one round trip: replies, then reads
            for (stream, count), reply in zip(reads, replies):
                entries = _entries(reply)
                self.backlog += entries  # admitted by the next _pull, before the next step
                if stream == self.stream:
                    self.interactive_drained = len(entries) < count
            self.backlog.sort(key=lambda e: e[0] != self.stream)  # interactive entries first
        if not self.outbox.held:
            self.backoff.reset()

    def _while_refused(self) -> None:
        """No step while Redis refuses the replies (they would pile up unsent), but a cancel or a
        passed deadline frees its KV now; their answers queue behind the held replies."""
        self._apply_cancels()
        self._expire_deadlines()
        if self.drain_deadline is not None and time.monotonic() > self.drain_deadline:
            self.stopping.set()  # what is unacked stays pending: a live worker resumes it
            return
        self.stopping.wait(self.backoff.next())

    def _expire_deadlines(self) -> None:
        now = time.time()
        for rid in [rid for rid, act in self.active.items() if now > act.deadline]:
            act = self.active.pop(rid)
            self.engine.abort(rid)
            self.outbox.reply(act.reply_channel, protocol.ErrorReply(
                request_id=rid, seq=act.next_seq(), code="timeout",
                message="request deadline passed while Redis refused writes"), act.version)
            self.outbox.finish(act.entry_id, rid, act.stream)
            self.counters["requests_aborted"] += 1
            self.metrics.finished(rid, "abort")
            log.info("timed out %s while Redis refused writes", rid, extra={"request_id": rid})

    def _until_redis(self, fn) -> None:
        while not self.stopping.is_set():
            try:
                return fn()
            except redis.RedisError as exc:
                log.warning("waiting for Redis: %s", refusal(exc) or exc)
                self.stopping.wait(self.backoff.next())

    # -- stream consumption ----------------------------------------------------------------
    def _ensure_group(self) -> None:
        for stream in (self.stream, self.batch_stream):
            try:
                self.redis.xgroup_create(stream, names.CONSUMER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def _pull(self) -> None:
        """Admit what was read (the last flush reads new entries for the room the engine had),
        then orphans; when the engine is idle and nothing waits, block on both lanes a while."""
        room = self.engine.free_capacity()
        todo, self.backlog = self.backlog[:room], self.backlog[room:]
        admitted = 0
        try:
            if len(todo) < room and time.monotonic() - self.last_claim >= self.s.heartbeat_s:
                self.last_claim = time.monotonic()
                known = {a.entry_id for a in self.active.values()} | {e[1] for e in todo + self.backlog}
                for stream in (self.stream, self.batch_stream):
                    orphans = claim_orphans(self.redis, stream, self.s.worker_id,
                                            int(self.s.heartbeat_ttl_s * 1000), room - len(todo), known)
                    todo += [(stream, o.entry_id, o.raw, o.times_delivered) for o in orphans]
            if not todo and room and not self.engine.has_unfinished():
                # idle: wait for either lane; one entry from each at most, the surplus waits its turn
                read = _entries(self.redis.xreadgroup(names.CONSUMER_GROUP, self.s.worker_id,
                                                      {self.stream: ">", self.batch_stream: ">"},
                                                      count=1, block=100))
                todo, self.backlog = read[:room], read[room:] + self.backlog
            for stream, entry_id, raw, delivered in todo:
                self._admit(stream, entry_id, raw, delivered)
                admitted += 1
        except redis.RedisError:  # what was read or claimed and not admitted waits for Redis
            self.backlog = todo[admitted:] + self.backlog
            raise

    def _next_reads(self) -> list[tuple[str, int]]:
        """What the next flush reads: as many new entries as the engine has room for. The batch lane
        gets only the room the interactive lane leaves: it is read when the interactive lane's last
        read came back short (and the engine's priorities keep its entries behind, too)."""
        room = self.engine.free_capacity() - len(self.backlog)
        if room <= 0:
            return []
        return [(self.stream, room)] + ([(self.batch_stream, room)] if self.interactive_drained else [])

    def _admit(self, stream: str, entry_id: bytes, raw: bytes, delivered: int) -> None:
        """Start one entry in the engine, or answer it with an error: nothing the entry carries may
        raise out of here (a Redis error may; the entry then waits in the backlog). `delivered`:
        how many times workers were handed it before this one claimed it (0: read fresh)."""
        entry = self._decode(stream, entry_id, raw, delivered)
        if entry is None:
            return
        rid = entry.request_id
        if self.redis.exists(names.cancelled_key(rid)):
            self.outbox.ack(entry_id, stream)
            self.counters["requests_aborted"] += 1
            return
        ckpt = checkpoint.load(self.redis, rid) if delivered else checkpoint.Checkpoint()
        if ckpt.done:  # its worker died after the last reply: nothing left to do
            self.outbox.finish(entry_id, rid, stream)
            return
        if refusal := self._refusal(entry, ckpt, delivered):
            self._fail(stream, entry_id, entry, ckpt, *refusal)
            return
        self.faults.delay()
        try:
            self._start(stream, entry_id, entry, ckpt, delivered)
        except redis.RedisError:
            raise
        except EngineRejected as exc:
            self.counters["requests_rejected"] += 1
            self._fail(stream, entry_id, entry, ckpt, exc.code, str(exc), exc.param)
        except ValueError as exc:  # before any compute: the tokenizer or a check refused the input
            self.counters["requests_rejected"] += 1
            self._fail(stream, entry_id, entry, ckpt, "invalid_request", str(exc))
        except Exception as exc:  # a bug one request's content reached: it fails, the worker goes on
            log.error("request %s failed at admission (%s)", rid, type(exc).__name__, exc_info=exc,
                      extra={"request_id": rid})
            if rid not in self.active:  # (a duplicate id would be the live request's)
                self.engine.abort(rid)
            self._fail(stream, entry_id, entry, ckpt, errors.EngineFailure.code,
                       f"the worker failed to start this request ({type(exc).__name__})")

    def _refusal(self, entry: protocol.RequestEntry, ckpt: checkpoint.Checkpoint,
                 delivered: int) -> tuple[str, str] | None:
        """(code, message) when the entry must be answered instead of run."""
        if delivered >= self.s.max_deliveries:
            self.counters["requests_poisoned"] += 1
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

    def _start(self, stream: str, entry_id: bytes, entry: protocol.RequestEntry,
               ckpt: checkpoint.Checkpoint, delivered: int) -> None:
        rid = entry.request_id
        prompt_ids = self._prompt_ids(entry)
        self.faults.crash_if_marked(entry.prompt, entry.messages)
        params = to_sampling_params(entry, self.engine.max_model_len - len(prompt_ids))
        resume = Resume(output_ids=ckpt.tokens, finished=set(ckpt.finished))
        self.engine.add_request(rid, prompt_ids, params, resume)
        self.outbox.logs.start(rid, ckpt.size)
        self.metrics.admitted(entry, len(prompt_ids))
        self.active[rid] = Active(entry_id, entry.reply_channel, entry.params.n, len(prompt_ids),
                                  seq=ckpt.last_seq, finished=set(ckpt.finished),
                                  completion_tokens={i: len(t) for i, t in ckpt.tokens.items()},
                                  stream=stream, version=entry.v, deadline=entry.deadline)
        self.counters["requests_admitted"] += 1
        if delivered:
            self.counters["requests_resumed"] += 1
            log.info("resumed %s after seq %d", rid, ckpt.last_seq, extra={"request_id": rid})
        if ckpt.empty:  # the admission verdict (last: nothing may fail after it), once per request
            self.outbox.reply(entry.reply_channel, protocol.Delta(
                request_id=rid, seq=self.active[rid].next_seq()), entry.v)

    def _decode(self, stream: str, entry_id: bytes, raw: bytes,
                delivered: int) -> protocol.RequestEntry | None:
        """The entry, or None once an entry that does not decode is answered (when it names whom
        to answer) and acknowledged: never dropped in silence, never left pending."""
        try:
            return protocol.decode_entry(raw)
        except Exception as exc:  # bad JSON, a schema version we do not read, invalid fields
            problem = exc
        to = protocol.addressee(raw)
        if to is None or to[1] is None:
            log.warning("dropping an entry that names no reply channel %s: %s", entry_id, _why(problem))
            self.outbox.ack(entry_id, stream)
            return None
        rid, channel = to
        version = _schema_of(raw)
        if type(version) is int and protocol.OLDEST_SCHEMA <= version <= protocol.SCHEMA_VERSION:
            code, message = "invalid_request", f"the worker could not read this request: {_why(problem)}"
        else:  # answered in our own version: a newer gateway reads the version before the rest
            code = errors.UnsupportedSchema.code
            message = (f"the request is in schema version {version!r}; this worker reads versions "
                       f"{protocol.OLDEST_SCHEMA}..{protocol.SCHEMA_VERSION}")
            version = protocol.SCHEMA_VERSION
        seq = checkpoint.load(self.redis, rid).last_seq + 1 if delivered else 1
        self._answer(channel, rid, seq, version, code, message)
        self.outbox.finish(entry_id, rid, stream)
        self.metrics.rejected(rid, code)
        return None

    def _prompt_ids(self, entry: protocol.RequestEntry) -> list[int]:
        from worker.engine.tokenizer import encode_prompt, render_chat

        if entry.prompt_token_ids is not None:
            return list(entry.prompt_token_ids)
        if entry.kind == "chat":
            return render_chat(self.tokenizer, entry.messages or [])
        return encode_prompt(self.tokenizer, entry.prompt or "")

    def _fail(self, stream: str, entry_id: bytes, entry: protocol.RequestEntry,
              ckpt: checkpoint.Checkpoint, code: str, message: str, param: str | None = None) -> None:
        """Answer an entry that never ran here with an error, and retire it."""
        self._answer(entry.reply_channel, entry.request_id, ckpt.last_seq + 1, entry.v, code, message,
                     param)
        self.outbox.finish(entry_id, entry.request_id, stream)
        self.metrics.rejected(entry.request_id, code, entry.trace)

    def _answer(self, channel: str, rid: str, seq: int, version: int, code: str, message: str,
                param: str | None = None) -> None:
        err = protocol.ErrorReply(request_id=rid, seq=seq, code=code, message=message, param=param,
                                  retryable=code in RETRYABLE)
        self.outbox.reply(channel, err, version)

    # -- replies ---------------------------------------------------------------------------
    def _collect(self, outputs: list[RequestOutput]) -> None:
        """Each output on its own: one that raises ends its request, never the loop."""
        for out in outputs:
            try:
                self._collect_one(out)
            except redis.RedisError:
                raise
            except Exception as exc:
                log.error("request %s failed while its output was sent (%s)", out.request_id,
                          type(exc).__name__, exc_info=exc, extra={"request_id": out.request_id})
                self._end_with_error(out.request_id, RequestError(
                    errors.EngineFailure.code, f"the worker failed on this request's output "
                    f"({type(exc).__name__}); it was ended alone"))

    def _collect_one(self, out: RequestOutput) -> None:
        act = self.active.get(out.request_id)
        if act is None:  # aborted meanwhile
            return
        if out.error is not None:
            self._end_with_error(out.request_id, out.error)
            return
        act.completion_tokens[out.index] = out.num_output_tokens
        self.metrics.output(out)
        self.outbox.reply(act.reply_channel, protocol.Delta(
            request_id=out.request_id, seq=act.next_seq(), index=out.index, text=out.text,
            token_ids=out.new_token_ids, logprobs=self._wire_logprobs(out),
            finish_reason=out.finish_reason if out.finished else None), act.version)
        if out.finished:
            act.finished.add(out.index)
            if len(act.finished) == act.n:
                self._done(out.request_id)

    def _end_with_error(self, rid: str, error: RequestError) -> None:
        """An admitted request failed: the engine lets it go, its client gets the error."""
        act = self.active.pop(rid, None)
        if act is None:
            return
        try:
            self.engine.abort(rid)  # its other choices, when the failure was not the engine's own
        except Exception as exc:
            log.error("abort of failed request %s raised (%s)", rid, type(exc).__name__, exc_info=exc)
        self._answer(act.reply_channel, rid, act.next_seq(), act.version, error.code, error.message)
        self.outbox.finish(act.entry_id, rid, act.stream)
        self.counters["requests_failed"] += 1
        self.metrics.rejected(rid, error.code)

    def _done(self, rid: str) -> None:
        act = self.active.pop(rid)
        self.outbox.reply(act.reply_channel, protocol.Done(
            request_id=rid, seq=act.next_seq(), prompt_tokens=act.prompt_tokens,
            completion_tokens=sum(act.completion_tokens.values())), act.version)
        self.outbox.finish(act.entry_id, rid, act.stream)
        self.counters["requests_finished"] += 1
        self.metrics.finished(rid)

    @cached_property
    def _token_text(self) -> TokenText:
        return TokenText(self.tokenizer)

    def _wire_logprobs(self, out: RequestOutput) -> list[dict] | None:
        """Per token: its text, real bytes and logprob, and every top entry's, in rank order.
        `top` stays [text, logprob] pairs, as a gateway of the previous release reads them."""
        if not out.logprobs:
            return None
        of = self._token_text.of
        return [{"token_id": lp.token_id, "token": of(lp.token_id)[0], "logprob": lp.logprob,
                 "bytes": of(lp.token_id)[1], "top": [[of(t)[0], v] for t, v in lp.top],
                 "top_ids": [t for t, _ in lp.top], "top_bytes": [of(t)[1] for t, _ in lp.top]}
                for lp in out.logprobs]

    # -- cancellation ----------------------------------------------------------------------
    def _cancel_loop(self) -> None:
        backoff = Backoff(0.1, 2.0)
        while not self.stopping.is_set():
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(names.CANCEL_CHANNEL)
                backoff.reset()
                while not self.stopping.is_set():
                    msg = pubsub.get_message(timeout=0.5)
                    if msg and msg["type"] == "message":
                        self._on_cancel(msg["data"])
            except redis.RedisError as exc:
                log.warning("cancel listener: %s; resubscribing", refusal(exc) or exc)
                self.stopping.wait(backoff.next())
            finally:
                pubsub.close()

    def _on_cancel(self, raw: bytes) -> None:
        try:
            self.cancels.put(protocol.decode_cancel(raw).request_id)
        except ValueError as exc:  # ProtocolError too: one bad message, not a reason to resubscribe
            log.warning("ignored an undecodable cancel: %s", exc)

    def _apply_cancels(self) -> None:
        """Aborted in the engine before the next step, so its blocks are free for that step."""
        while not self.cancels.empty():
            rid = self.cancels.get_nowait()
            act = self.active.pop(rid, None)
            if act is None:
                continue
            self.engine.abort(rid)
            self.outbox.finish(act.entry_id, rid, act.stream)
            self.counters["requests_aborted"] += 1
            self.metrics.finished(rid, "abort")
            log.info("aborted %s on cancel", rid, extra={"request_id": rid})

    # -- registry --------------------------------------------------------------------------
    def _info(self) -> dict:
        return {"worker_id": self.s.worker_id, "served_name": self.s.served_name,
                "version": self.s.version, "engine": self.s.engine, "stream": self.stream,
                "max_model_len": self.engine.max_model_len, **self.engine.kv_cache_fields(),
                "vocab_size": self.engine.vocab_size,
                "eos_token_ids": sorted(self.engine.eos_token_ids),
                "bos_token_id": self.engine.bos_token_id, "schema": protocol.SCHEMA_VERSION,
                "draining": self.drain_deadline is not None,
                "active": len(self.active), "stats": self.engine.stats(), **self.counters,
                "metrics_url": self.metrics.url, "ts": time.time()}

    def _register_model(self) -> None:
        self.redis.hset(names.model_versions_key(self.s.served_name), self.s.version,
                        orjson.dumps({"model": self.s.model, "registered": time.time()}))

    def _heartbeat_loop(self) -> None:
        failing = False  # log when heartbeats start and stop failing, not every beat
        while not self.stopping.is_set():
            try:
                self.heartbeat()
                if failing:
                    log.info("heartbeat sent again")
                failing = False
            except redis.RedisError as exc:
                if not failing:
                    log.warning("heartbeat failed: %s; retrying every beat", refusal(exc) or exc)
                failing = True
            except Exception:  # a thread that dies quietly would make the worker look dead
                log.exception("heartbeat failed")
            self.stopping.wait(self.s.heartbeat_s)

    def heartbeat(self) -> None:
        now = time.time()
        pipe = self.redis.pipeline(transaction=False)
        ttl = max(1, int(self.s.heartbeat_ttl_s))
        pipe.set(names.worker_key(self.s.worker_id), orjson.dumps(self._info()), ex=ttl)
        # a full Redis refuses the SET but not EXPIRE: the entry stays, nobody takes our requests over
        pipe.expire(names.worker_key(self.s.worker_id), ttl)
        pipe.zadd(names.WORKERS_ZSET, {self.s.worker_id: now + self.s.heartbeat_ttl_s})
        pipe.zremrangebyscore(names.WORKERS_ZSET, "-inf", now)
        pipe.hsetnx(names.model_versions_key(self.s.served_name), self.s.version,
                    orjson.dumps({"model": self.s.model, "registered": now}))  # survives a Redis restart
        pipe.execute()

    def _deregister(self) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(names.worker_key(self.s.worker_id))
            pipe.zrem(names.WORKERS_ZSET, self.s.worker_id)
            pipe.execute()
        except redis.RedisError:
            pass


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
