"""The worker service: pulls request entries from its Redis stream (and orphans of dead workers),
runs them on an engine, and publishes every delta to the entry's reply channel, with a checkpoint
log that lets another worker resume the request. The engine knows nothing of Redis; this does.

`WorkerService` keeps the serving loop and composes the parts, one concept each: the stream consumer
(worker/consumer.py), admission (worker/admission.py; long prompts are made in worker/prompt_thread.py
while the loop steps), the requests in flight and their replies
(worker/inflight.py, worker/replies.py), the cancel listener (worker/cancels.py) and the registry
heartbeat (worker/heartbeat.py). No Redis error ends the worker: what was read and not admitted waits
in the consumer's backlog, what was not sent in the outbox; both go on when Redis answers again.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter


from shared import protocol
from shared.backoff import Backoff
from shared.redis_client import sync_client
from shared.redis_errors import REDIS_ERRORS, refusal
from shared.settings import WorkerSettings
from worker.admission import Admission, short
from worker.cancels import CancelListener, HeardCancels
from worker.consumer import PendingEntry, StreamConsumer
from worker.fairness import FairOrder
from worker.heartbeat import Heartbeat
from worker.inflight import InFlight
from worker.metrics import WorkerMetrics
from worker.prompt_thread import PromptThread
from worker.replies import Outbox
from worker.engine.chat_markers import chat_markers
from worker.thinking import Markers

log = logging.getLogger("kvgate.worker")

# An idle loop waits this long at most for a long prompt being made, then reads the streams again:
# while it waits nothing new is read, so a request arriving then waits too (at 50 ms, one key's
# long prompts added ~50 ms to every other key's TTFT on an idle worker).
IDLE_WAIT_S = 0.005


class WorkerService:
    def __init__(self, settings: WorkerSettings, engine, tokenizer):
        self.s = settings
        self.engine = engine
        self.redis = sync_client(settings, socket_connect_timeout=2, socket_timeout=10,
                                 health_check_interval=10)
        self.stopping = threading.Event()
        self.drain_deadline: float | None = None
        self.backoff = Backoff(0.05, 2.0)  # between tries while Redis refuses or errs
        self.metrics = WorkerMetrics(settings.served_name, settings.version, settings.worker_id,
                                     engine.stats)
        self.fair = FairOrder() if settings.fair_order else None
        self.consumer = StreamConsumer(self.redis, settings, self.fair)
        if self.fair is not None and hasattr(engine, "scheduler"):  # the paged engine's waiting queue
            engine.scheduler.waiting_order = self.fair.request_counter
        # a tenant below its share of a full batch starts at once (the paged engine preempts for it)
        self.yielding = self.fair is not None and settings.fair_yield and hasattr(engine, "yield_slot")
        self.outbox = Outbox(self.redis, self.consumer.stream, settings.worker_id,
                             settings.max_checkpoint_bytes)
        self.inflight = InFlight(engine, self.outbox, self.metrics, tokenizer, settings.hold_s,
                                 settings.first_hold_s)
        markers = Markers.of(tokenizer, settings.reasoning_parser) if settings.reasoning_parser else None
        self.chat_markers = chat_markers(tokenizer)  # for clients that write chats as text (kvgate.lang)
        self.cancels = CancelListener(self.redis, self.stopping)
        self.heard = HeardCancels(self.cancels)  # cancels of requests not running here (yet)
        self.admission = Admission(settings, self.redis, engine, tokenizer, self.outbox, self.metrics,
                                   self.inflight, markers, self.heard)
        self.prompts = PromptThread()  # long prompts, made while the loop steps
        self.heartbeat = Heartbeat(self.redis, settings, self.stopping, self.registry_entry)
        self.step_s = math.inf  # how long the last engine step took (none yet: assume long)

    def run(self) -> None:
        self._until_redis(self.consumer.ensure_groups)
        self._until_redis(self.heartbeat.register_model)
        # said before the first heartbeat: whoever sees this worker in the registry finds the line logged
        log.info("worker %s serving %s:%s on %s (reasoning parser %s, tool call parser %s)",
                 self.s.worker_id, self.s.served_name, self.s.version, self.consumer.stream,
                 self.s.reasoning_parser, self.s.tool_call_parser,
                 extra={"reasoning_parser": self.s.reasoning_parser, "tool_call_parser": self.s.tool_call_parser})
        self.heartbeat.start()
        self.cancels.start()
        try:
            while not self.stopping.is_set():
                try:
                    self._iteration()
                except REDIS_ERRORS as exc:
                    self._on_redis_error(exc)
        finally:
            self.prompts.close()
            self.heartbeat.deregister()

    def stop(self) -> None:
        self.stopping.set()

    def drain(self) -> None:
        """Stop pulling; finish in-flight requests within the grace period; leave the rest pending
        (and deregister) so live workers claim and resume them."""
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.s.drain_grace_s
            log.info("draining: %d requests in flight", len(self.inflight))
        if not self.inflight:  # nothing to finish: stop now, even while Redis is away
            self.stopping.set()

    def registry_entry(self) -> dict:
        """What the heartbeat writes to the registry: what this worker serves, its load, its counts."""
        s, engine = self.s, self.engine
        return {"worker_id": s.worker_id, "served_name": s.served_name, "version": s.version,
                "engine": s.engine, "stream": self.consumer.stream, "max_model_len": engine.max_model_len,
                **engine.kv_cache_fields(), "vocab_size": engine.vocab_size,
                "eos_token_ids": sorted(engine.eos_token_ids), "bos_token_id": engine.bos_token_id,
                "schema": protocol.SCHEMA_VERSION, "draining": self.drain_deadline is not None,
                "reasoning_parser": s.reasoning_parser, "tool_call_parser": s.tool_call_parser,
                "chat_markers": self.chat_markers, "task": getattr(engine, "task", "generate"),
                "active": len(self.inflight), "stats": engine.stats(),
                **self.metrics.outcomes.registry_fields(), "metrics_url": self.metrics.url,
                "ts": time.time()}

    def _iteration(self) -> None:
        self.outbox.flush()
        if self.outbox.refused:  # Redis refuses: keep the replies, step no further
            self._while_refused()
            return
        self._apply_cancels()
        draining = self.drain_deadline is not None
        if draining:
            if not self.inflight or time.monotonic() > self.drain_deadline:
                self.stopping.set()
                return
        else:
            self._admit_made()
            self._pull()
            if self._answer_first():
                self.outbox.flush()
                if self.outbox.refused:
                    return
        self._step()
        if self.prompts and not draining and not self.engine.has_unfinished():
            self.prompts.wait(IDLE_WAIT_S)  # nothing to step: the next thing to do is its admission
        self.inflight.release_due()
        reads = [] if draining else self.consumer.next_reads(self.engine.free_capacity(), self.yielding,
                                                             quiet=self.outbox.empty)
        if (replies := self.outbox.flush(reads)) is not None:  # one round trip: replies, then reads
            self.consumer.received(reads, replies)
        if not self.outbox.refused:
            self.backoff.reset()

    def _answer_first(self) -> bool:
        """What admission answered (a stream's verdict) goes out ahead of the step when the step
        takes longer than the round trip: the gateway then sends the 200 while the prompt is
        prefilled instead of after it; an engine faster than Redis (the synthetic one) sends it
        with the first token, as one round trip (docs/performance.md, "The verdict before the
        prefill")."""
        return not self.outbox.empty and self.step_s > self.outbox.round_trip_s

    def _step(self) -> None:
        outputs = []
        if self.engine.has_unfinished():
            started = time.perf_counter()
            outputs = self.engine.step()
            self.inflight.collect(outputs)
            self.admission.faults.pause_step()
            self.step_s = time.perf_counter() - started
        if self.fair is not None:  # each tenant charged its tokens of this step
            self.fair.served(outputs, alive=self.inflight.__contains__)

    def _pull(self) -> None:
        """Admit what the consumer hands over, one entry at a time so each choice sees the counters
        the last one moved (what the last flush read, then orphans; when the engine is idle, a
        short blocking read)."""
        room = self.engine.free_capacity() - len(self.prompts)
        if room <= 0 and not self.prompts:
            room = self._make_room()
        idle = not self.engine.has_unfinished() and not self.prompts
        self.consumer.take(room, idle=idle, known=self._known_entries)
        for _ in range(room):  # with the prompt thread full, short entries still start
            if (pending := self.consumer.next(short if self.prompts.full() else None)) is None:
                break
            try:
                waiting = self.admission.admit(pending)
            except REDIS_ERRORS:  # this entry and the rest wait for Redis
                self.consumer.put_back([pending])
                raise
            if waiting is not None:
                self.prompts.submit(waiting)
            else:
                self._started(pending)

    def _admit_made(self) -> None:
        """The entries whose long prompts are made, admitted (in the order they were taken)."""
        while (done := self.prompts.made()) is not None:
            waiting, made = done
            try:
                self.admission.resume(waiting, made.result)
            except REDIS_ERRORS:  # taken again from the backlog once Redis answers (made anew)
                self.consumer.put_back([waiting.pending])
                raise
            if not self._started(waiting.pending) and self.fair is not None:
                self._charge_made(waiting.pending)

    def _charge_made(self, p: PendingEntry) -> None:
        """A long prompt made but never started (refused: beyond the context, say; or a tokenize
        answer) still took the prompt thread for as long as its length: its tenant is charged ~a
        token per 4 bytes of it. Uncharged, a key flooding over-long prompts always had the least
        counter, went first, and another key's long prompts waited for the thread for ever."""
        self.fair.charge(p.claim.tenant, len(p.raw) // 4, p.claim.weight)

    def _known_entries(self) -> set[bytes]:
        """This worker's entries that are not lost: in flight, their long prompt being made, or over
        with their ack still queued (a request cancelled in this iteration: claimed back, it was
        counted aborted twice)."""
        return self.inflight.entry_ids() | self.outbox.acking() | self.prompts.entry_ids()

    def _make_room(self) -> int:
        """A full batch, under the fair order: when the next entry's tenant is below its share of
        the sequence slots and a tenant served more is above its own, one of that tenant's running
        sequences (in the entry's lane or a worse one, of its priority or a worse one) yields its
        slot (recomputed later); returns the room made, 0 or 1."""
        if not self.yielding or (candidate := self.consumer.peek()) is None:
            return 0
        running = self.engine.running_requests()
        holders = Counter(t for rid in running if (t := self.fair.tenant_of(rid)) is not None)
        victim = self.fair.over_share(candidate.claim, holders, self.engine.config.max_num_seqs)
        if victim is None:
            return 0
        lane = self.consumer.lane(candidate.stream)
        ids = {rid for rid in running if self.fair.tenant_of(rid) == victim
               and self.consumer.lane(getattr(self.inflight.requests.get(rid), "stream", None)) >= lane}
        return int(self.engine.yield_slot(ids, candidate.claim.priority))

    def _started(self, p: PendingEntry) -> bool:
        """Under the fair order, an admitted request's prompt is charged to its tenant now; whether
        it was admitted (started in the engine)."""
        act = self.inflight.requests.get(p.claim.request_id) if self.fair and p.claim.request_id else None
        if act is not None and act.entry_id == p.entry_id:
            self.fair.started(p.claim.request_id, p.claim, act.prompt_tokens)
            return True
        return False

    def _apply_cancels(self) -> None:
        """Aborted in the engine before the next step, so its blocks are free for that step; the
        others are kept for admission (their entry may still be on its way)."""
        for request_id in self.cancels.take():
            if request_id in self.inflight:
                self.inflight.cancel(request_id)
            else:
                self.heard.add(request_id)

    def _while_refused(self) -> None:
        """No step while Redis refuses the replies (they would pile up unsent), but a cancel or a
        passed deadline frees its KV now; their answers queue behind the held replies."""
        self._apply_cancels()
        self.inflight.expire()
        if self.drain_deadline is not None and time.monotonic() > self.drain_deadline:
            self.stopping.set()  # what is unacked stays pending: a live worker resumes it
            return
        self.stopping.wait(self.backoff.next())

    def _on_redis_error(self, exc: Exception) -> None:
        if "NOGROUP" in str(exc):  # Redis came back without our streams: make them again
            self._until_redis(self.consumer.ensure_groups)
            return
        log.warning("Redis error, retrying: %s", refusal(exc) or exc)
        self.stopping.wait(self.backoff.next())

    def _until_redis(self, fn) -> None:
        while not self.stopping.is_set():
            try:
                return fn()
            except REDIS_ERRORS as exc:
                log.warning("waiting for Redis: %s", refusal(exc) or exc)
                self.stopping.wait(self.backoff.next())
