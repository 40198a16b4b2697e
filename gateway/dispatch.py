"""Dispatch: XADD a request entry, then hand its replies (demultiplexed by request id from this
process's reply channel) to whoever awaits them. Subscribed before the first XADD, always.
"""
from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway import retry
from gateway.breaker import GATE, GATE_GRANT, Breaker, Refused, counts_against
from gateway.errors import redis_unavailable
from gateway.limits import ADMIT, AdmitCall, Verdict
from gateway.queue_gate import QueueGate
from gateway.reply_queue import ReplyQueue, Unread
from gateway.timeouts import Timeouts
from shared import names, protocol
from shared.redis_client import is_cluster
from shared.errors import (EngineFailure, KvgateError, Overloaded, PayloadTooLarge, RequestTimeout,
                           ResumeFailed, UnsupportedSchema, from_code)
from shared.telemetry import traced

log = logging.getLogger("kvgate.gateway")
KEEPALIVE = None  # what `replies()` yields when nothing arrived for a keep-alive interval
RESYNC = object()  # put in every open queue after a resubscribe: replies may have been missed
CANCEL_MARK_TTL_S = 600
FOLLOW_POLL_S = 0.05  # how often a follower reads the reply log when it cannot hear its worker
FOLLOW_WAKE_S = 0.5  # ... and when it can (a message it missed is read this much later at most)
LOG_PAGE = 256  # reply-log lines a resumed stream reads at a time
# Backpressure: enqueue only while the stream (waiting + in-flight entries) is below its depth.
# An interactive entry also (re)sets its model's interactive mark (KEYS[2], ARGV[4] ms; 0: none),
# and a first attempt passes its version's circuit breaker (KEYS[3], when ARGV[5] is 1), all in
# the same round trip (one `{m:}` slot). Answers {'refused', ms to wait}, {'full'}, or the new
# entry's id, the breaker's verdict ('go' or 'probe') and the state it entered ('' or 'half_open').
_XADD_BOUNDED = """
local gate_key, gate_hold, gate_token = KEYS[3], tonumber(ARGV[6]), ARGV[7]
local verdict, gate_wait, entered, gate_now = 'go', 0, '', 0
if ARGV[5] == '1' then
""" + GATE + """
end
if verdict == 'refused' then return {'refused', gate_wait} end
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then return {'full'} end
""" + GATE_GRANT + """
if ARGV[4] ~= '0' then redis.call('SET', KEYS[2], '1', 'PX', ARGV[4]) end
return {redis.call('XADD', KEYS[1], '*', ARGV[2], ARGV[3]), verdict, entered}
"""
# The key's limits (gateway/limits.py ADMIT: KEYS 1-4, ARGV 1-9, its own `{k:}` slot) and then, if
# they admit, the bounded XADD (KEYS 5-7, ARGV 10-16): admission in one round trip, on one Redis
# only (a cluster keeps them apart: two slots). Answers {limits' answer} or {limits', XADD's}.
ADMIT_KEYS, ADMIT_ARGS = 4, 9
_ADMIT_THEN_XADD = """
local function admit(KEYS, ARGV)
""" + ADMIT + """
end
local function enqueue(KEYS, ARGV)
""" + _XADD_BOUNDED + """
end
-- Out of memory, Redis refuses a write that needs memory only while the script has written nothing
-- (ADMIT's clean-ups would let the XADD through): so a first write that changes nothing, refused
-- then, keeps "a full Redis takes no request" (the interactive mark, rewritten as it is, if set).
redis.call('SET', KEYS[6], '1', 'XX', 'KEEPTTL')
local limits = admit({KEYS[1], KEYS[2], KEYS[3], KEYS[4]}, {unpack(ARGV, 1, %(n)d)})
if limits[1] ~= %(admitted)d then return {limits} end
return {limits, enqueue({KEYS[5], KEYS[6], KEYS[7]}, {unpack(ARGV, %(n1)d, #ARGV)})}
""" % {"n": ADMIT_ARGS, "n1": ADMIT_ARGS + 1, "admitted": Verdict.ADMITTED}


class Dispatcher:
    def __init__(self, redis: aioredis.Redis, gateway_id: str, max_stream_depth: int = 1000,
                 interactive_mark_ms: int = 1000, max_entry_bytes: int = 1 << 20,
                 max_retries: int = 0, retarget: retry.Retarget | None = None,
                 breaker: Breaker | None = None, queued_per_key: int = 0,
                 unread: Unread | None = None):
        self.redis = redis
        self.unread = unread or Unread(per_request=16384, in_all=262144)  # replies clients left unread
        # a key's interactive requests on a stream, not yet admitted (gateway/queue_gate.py)
        self.queue_gate = QueueGate(queued_per_key, max_stream_depth)
        self.breaker = breaker  # told each attempt's failure, and a probe's first token
        self.max_retries = max_retries  # sends again of a request that failed before its first token
        self.retarget = retarget  # where such a retry goes (None: the same version, same schema)
        self.max_stream_depth = max_stream_depth
        self.max_entry_bytes = max_entry_bytes
        self.interactive_mark_ms = interactive_mark_ms
        self._xadd_bounded = redis.register_script(_XADD_BOUNDED)
        self._admit_then_xadd = redis.register_script(_ADMIT_THEN_XADD)
        self.channel = names.reply_channel(gateway_id)
        self.queues: dict[str, ReplyQueue] = {}
        # resumed streams: the other gateways' channels their workers publish to, and the
        # followers a message there wakes (LogFollower reads its log at once, not at the next poll)
        self.watched: dict[str, int] = {}
        self.wakers: dict[str, set[asyncio.Event]] = {}
        self._pubsub = None
        self.also: dict[str, tuple[Callable[[bytes], None], Callable[[], None]]] = {}
        self.subscribed = asyncio.Event()
        self._listener: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

    def listen_also(self, channel: str, on_message: Callable[[bytes], None],
                    on_subscribed: Callable[[], None]) -> None:
        """Before `start`: another channel on the same subscription; `on_subscribed` runs each time
        the subscription is (re)made (what was published while it was down is lost)."""
        self.also[channel] = (on_message, on_subscribed)

    async def start(self) -> None:
        self._listener = asyncio.create_task(self._listen_forever())
        await asyncio.wait_for(self.subscribed.wait(), timeout=10)

    async def stop(self) -> None:
        if self._listener:
            self._listener.cancel()

    async def _listen_forever(self) -> None:
        while True:
            try:
                await self._listen()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis went away: resubscribe when it is back
                self.subscribed.clear()
                log.warning("reply listener lost Redis (%s); reconnecting", type(exc).__name__)
                await asyncio.sleep(0.5)

    async def _listen(self) -> None:
        await self.redis.ping()  # a cluster client learns its slot map here; pubsub needs it
        pubsub = self.redis.pubsub()
        own = self.channel.encode()
        also = {channel.encode(): handlers for channel, handlers in self.also.items()}
        await pubsub.subscribe(self.channel, *self.also, *self.watched)
        self._pubsub = pubsub
        try:
            async for msg in pubsub.listen():
                if msg["type"] == "message":
                    if msg["channel"] == own:
                        self._deliver(msg["data"])
                    elif (handlers := also.get(msg["channel"])) is not None:
                        handlers[0](msg["data"])
                    else:
                        self._wake(protocol.addressees(msg["data"]))
                elif msg["type"] == "subscribe" and msg["channel"] == own:
                    for _, on_subscribed in self.also.values():  # one SUBSCRIBE: all are live now
                        on_subscribed()
                    self.subscribed.set()
                    for queue in self.queues.values():  # published while we were away?
                        queue.put_nowait(RESYNC)
                    for wakers in self.wakers.values():
                        for waker in wakers:
                            waker.set()
        finally:
            self._pubsub = None
            await pubsub.aclose()

    async def watch(self, channel: str | None, request_id: str) -> asyncio.Event:
        """A follower's wake-up: set when a message for `request_id` is published on `channel` (the
        channel of the gateway that dispatched it; None when unknown: nothing sets it)."""
        waker = asyncio.Event()
        self.wakers.setdefault(request_id, set()).add(waker)
        if channel and channel != self.channel:
            self.watched[channel] = self.watched.get(channel, 0) + 1
            if self.watched[channel] == 1 and self._pubsub is not None:
                try:
                    await self._pubsub.subscribe(channel)
                except Exception as exc:  # the follower polls its log regardless
                    log.warning("could not listen on %s: %s", channel, type(exc).__name__)
        return waker

    def unwatch(self, channel: str | None, request_id: str, waker: asyncio.Event) -> None:
        """Undoes one `watch` (a second call does nothing)."""
        wakers = self.wakers.get(request_id, set())
        if waker not in wakers:
            return
        wakers.discard(waker)
        if not wakers:
            del self.wakers[request_id]
        if not channel or channel not in self.watched:
            return
        self.watched[channel] -= 1
        if self.watched[channel] == 0:
            del self.watched[channel]
            if self._pubsub is not None:
                self.spawn(self._pubsub.unsubscribe(channel))

    def _wake(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            for waker in self.wakers.get(request_id, ()):
                waker.set()

    def _deliver(self, raw: bytes) -> None:
        """One message carries a worker step's replies to this gateway; each goes to its request.
        A message this gateway cannot read (a worker of a schema it does not speak) ends the
        requests it names with an error at once, rather than leaving them to time out."""
        try:
            replies = protocol.decode_replies(raw)
        except ValueError as exc:
            log.warning("undecodable replies: %s", exc)
            for request_id in protocol.addressees(raw):
                if (queue := self.queues.get(request_id)) is not None:
                    queue.put_nowait(UnsupportedSchema(
                        f"the worker's reply could not be read by this gateway ({exc}); the gateway "
                        "and the workers of this model are more than one release apart"))
            return
        for reply in replies:
            queue = self.queues.get(reply.request_id)
            if queue is not None:
                queue.put_nowait(reply)
                if self.unread.over(queue):
                    self._overrun(reply.request_id, queue)
            elif self.wakers:
                self._wake([reply.request_id])  # resumed here, dispatched here too

    def _overrun(self, request_id: str, queue: ReplyQueue) -> None:
        """A client has stopped reading (gateway/reply_queue.py): the request with the most unread
        replies, this one or, past the gateway's bound, the worst of all, is ended and cancelled."""
        if queue.qsize() <= self.unread.per_request:
            request_id, queue = max(self.queues.items(), key=lambda item: item[1].qsize())
        log.warning("request %s ended: its client left %d replies unread", request_id, queue.qsize())
        del self.queues[request_id]
        queue.overrun(self.unread.per_request, self.unread.in_all)
        self.cancel_soon(request_id, "client_not_reading")

    @traced("dispatch")
    async def submit(self, stream: str, entry: protocol.RequestEntry, interactive: bool = True,
                     schema: int | None = None, probe: str | None = None,
                     timeouts: Timeouts | None = None, gate: bool = False,
                     before: AdmitCall | None = None) -> "Handle":
        """Enqueue, in the schema the stream's workers speak (`schema`, the oldest among them; None:
        workers from before they said, which spoke 1); an interactive entry also marks its model
        busy for the batch runners. `probe`: the breaker's token if this request is its version's
        probe (its first token closes the breaker). `gate`: pass the version's breaker in the same
        script (Refused if it is open; the probe's token comes from there). `timeouts`: its
        limits, counted from `entry.created` (the total is the entry's deadline). An interactive
        entry first waits for its key's place on the stream (gateway/queue_gate.py). `before`:
        the key's limits, checked first (raising their 429): in the XADD's round trip on one
        Redis when the key's place is free now, else on their own before the wait."""
        if before is not None and not self._joins(before, stream, entry, interactive):
            before.conclude(await before.alone())
            before = None
        first_token_by = timeouts.first_token_by(entry.created) if timeouts is not None else math.inf
        admitted = await self._place(stream, entry, interactive, min(first_token_by, entry.deadline),
                                     timeouts)
        try:
            queue, granted = await self._enqueue(stream, entry, interactive, schema, gate, before)
        except BaseException:
            admitted()
            raise
        handle = Handle(self, entry.request_id, queue, entry.deadline,
                        attempt=Attempt(stream, entry, interactive, schema))
        handle.probe, handle.admitted = granted or probe, admitted
        if timeouts is not None:
            handle.timeouts, handle.first_token_by = timeouts, first_token_by
        return handle

    def _joins(self, before: AdmitCall, stream: str, entry: protocol.RequestEntry, interactive: bool) -> bool:
        """Whether the limits can ride in the XADD's script: one Redis, and no wait for a place
        between them (a request waits for its place only once its limits admitted it)."""
        shaped = len(before.keys) == ADMIT_KEYS and len(before.args) == ADMIT_ARGS
        return (shaped and not is_cluster(self.redis)
                and self.queue_gate.open_now(entry.key_id if interactive else None, stream))

    async def _place(self, stream: str, entry: protocol.RequestEntry, interactive: bool, by: float,
                     timeouts: Timeouts | None) -> Callable[[], None]:
        """Waits for the key's place on `stream` (an interactive entry only), until `by`."""
        def late() -> Exception:
            if timeouts is not None and by < entry.deadline:
                return timeouts.no_first_token()
            return timeouts.total_passed() if timeouts is not None else \
                RequestTimeout("request exceeded its total time limit")
        return await self.queue_gate.enter(entry.key_id if interactive else None, stream, entry.model,
                                           by - time.time(), late, entry.priority)

    async def enqueue(self, stream: str, entry: protocol.RequestEntry, interactive: bool,
                      schema: int | None) -> asyncio.Queue:
        """The bounded XADD; the queue its replies will arrive on (registered before the XADD)."""
        return (await self._enqueue(stream, entry, interactive, schema, gate=False))[0]

    async def _enqueue(self, stream: str, entry: protocol.RequestEntry, interactive: bool,
                       schema: int | None, gate: bool,
                       before: AdmitCall | None = None) -> tuple[asyncio.Queue, str | None]:
        if not self.subscribed.is_set():
            raise Overloaded("gateway is reconnecting to Redis; retry shortly", retry_after=1)
        raw = protocol.encode(entry, version=protocol.peer_version(schema))
        if len(raw) > self.max_entry_bytes:  # what one request may hold of Redis's memory
            raise PayloadTooLarge(f"The request takes {len(raw)} bytes as a queue entry; the limit "
                                  f"is {self.max_entry_bytes} bytes (KVGATE_MAX_ENTRY_BYTES)")
        gate = gate and self.breaker is not None and self.breaker.enabled
        token = secrets.token_hex(8) if gate else ""
        queue = ReplyQueue(self.unread)
        self.queues[entry.request_id] = queue
        mark_ms = self.interactive_mark_ms if interactive else 0
        keys = [stream, names.interactive_mark(entry.model), names.breaker_state(entry.model, entry.version)]
        args = [self.max_stream_depth, protocol.ENTRY_FIELD, raw, mark_ms, int(gate),
                self.breaker.open_ms if gate else 0, token]
        try:
            if before is None:
                added = await self._xadd_bounded(keys=keys, args=args)
            else:
                answer = await self._admit_then_xadd(keys=before.keys + keys, args=before.args + args)
        except Exception as exc:
            self.queues.pop(entry.request_id, None)
            raise redis_unavailable(exc) from exc
        if before is not None:
            try:
                before.conclude(answer[0])  # the key's 429, if its limits refused (nothing was added)
            except BaseException:
                self.queues.pop(entry.request_id, None)
                raise
            added = answer[1]
        if added[0] in (b"refused", b"full"):
            self.queues.pop(entry.request_id, None)
            if added[0] == b"refused":
                raise Refused(int(added[1]) / 1000)
            raise Overloaded(f"model '{entry.model}' is at its queue depth limit of "
                             f"{self.max_stream_depth} requests; retry shortly", retry_after=2)
        if gate:
            self.breaker.moved(entry.model, entry.version, added[2])
        return queue, token if gate and added[1] == b"probe" else None

    def cancel_soon(self, request_id: str, reason: str) -> None:
        """Fire-and-forget: safe to call from a cancelled task's `finally`."""
        self.spawn(self._cancel(request_id, reason))

    def spawn(self, work: Awaitable) -> None:
        """`work` on a task of its own, kept until done; its failure is logged, never raised."""
        async def quietly() -> None:
            try:
                await work
            except Exception as exc:  # Redis away: nothing waits on it
                log.debug("background Redis call failed: %s", type(exc).__name__)
        task = asyncio.create_task(quietly())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel(self, request_id: str, reason: str) -> None:
        try:
            cancel = protocol.Cancel(request_id=request_id, reason=reason)
            # every worker reads the cancel channel: written in the oldest schema any may speak
            message = protocol.encode(cancel, version=protocol.OLDEST_SCHEMA)
            if is_cluster(self.redis):  # a cluster pipeline refuses PUBLISH: mark first, then tell
                await self.redis.set(names.cancelled_key(request_id), reason, ex=CANCEL_MARK_TTL_S)
                await self.redis.publish(names.CANCEL_CHANNEL, message)
                return
            pipe = self.redis.pipeline(transaction=False)
            pipe.set(names.cancelled_key(request_id), reason, ex=CANCEL_MARK_TTL_S)
            pipe.publish(names.CANCEL_CHANNEL, message)
            await pipe.execute()
        except Exception as exc:
            log.warning("could not publish cancel for %s: %s", request_id, exc)

    def release(self, request_id: str) -> None:
        queue = self.queues.pop(request_id, None)
        if queue is not None:
            queue.detach()


@dataclass(frozen=True)
class Attempt:
    """What sending a request (again) takes."""

    stream: str
    entry: protocol.RequestEntry
    interactive: bool
    schema: int | None

    @property
    def lane(self) -> str:
        return self.stream.rpartition(":")[2]


class Handle:
    """The replies of one request, in sequence order: duplicates dropped, gaps filled from the
    request's checkpoint log (or refused with a clear error, never passed over in silence); sent
    again when it fails before its first token (gateway/retry.py)."""

    def __init__(self, dispatcher: Dispatcher, request_id: str, queue: asyncio.Queue,
                 deadline: float, attempt: Attempt | None = None):
        self.dispatcher = dispatcher
        self.request_id = request_id  # of the attempt in flight: its replies, log and cancel
        self.client_id = request_id  # the id the client knows, whichever attempt serves it
        self.attempt = attempt
        self.retries = 0
        self.on_attempt: Callable[[str], Awaitable[None]] | None = None  # told each retry's id
        # told (version, error) of each failure a retry absorbed: the canary analysis counts it
        self.on_absorbed: Callable[[str, KvgateError], None] | None = None
        self.queue = queue
        self.deadline = deadline
        self.last_seq = 0
        self.done = False
        self.tokens = 0  # tokens the worker produced that this handle saw
        self.refused = False  # the worker answered with an error before producing any token
        self.outlives_client = False  # a client that leaves does not cancel it (a resume may come)
        self.probe: str | None = None  # the breaker's token while this attempt probes its version
        self.timeouts: Timeouts | None = None  # what the limits are called in a timeout's message
        self.first_token_by = math.inf  # time.time() by which a token must have come (or done)
        self.gave_up = False  # a time limit passed: the request is cancelled as a timeout
        self.admitted: Callable[[], None] = _nothing  # gives back its key's place on the stream
        self.closed = False  # close() ran: the request is let go once, whoever calls it again

    @property
    def version(self) -> str | None:
        """The version the attempt in flight was sent to (a retry may move it); None: unknown."""
        return self.attempt.entry.version if self.attempt else None

    async def replies(self, keepalive_s: float) -> AsyncIterator[protocol.Delta | protocol.Done | None]:
        """Deltas then one Done; KEEPALIVE (None) every `keepalive_s` of silence; errors raise,
        but those before the first token that a retry may cure send the request again first."""
        while True:
            try:
                async for reply in self._replies(keepalive_s):
                    if self.probe is not None and (self.tokens or self.done):
                        await self._verdict(None)
                    yield reply
                return
            except KvgateError as exc:
                await self._verdict(exc)
                if not await self._again(exc):
                    raise

    async def _verdict(self, exc: KvgateError | None) -> None:
        """Tells the breaker of the attempt's version a failure (even one a retry absorbs), or that
        its probe got a token; Redis trouble here never changes the request's own course."""
        breaker, attempt, probe = self.dispatcher.breaker, self.attempt, self.probe
        if breaker is None or attempt is None or (exc is not None and not counts_against(exc)):
            return
        self.probe = None
        try:
            if exc is not None:
                await breaker.failed(attempt.entry.model, attempt.entry.version, probe)
            elif probe is not None:
                await breaker.succeeded(attempt.entry.model, attempt.entry.version, probe)
        except Exception as failure:
            log.warning("circuit breaker of %s not told: %s", attempt.entry.version, type(failure).__name__)

    async def _again(self, exc: KvgateError) -> bool:
        """Sends the request again if it may be: no token yet, a retry left, an error the request
        is not to blame for. The original error stands if the retry cannot be queued."""
        if (self.attempt is None or self.tokens or self.retries >= self.dispatcher.max_retries
                or not retry.retryable(exc)):
            return False
        old, first = self.attempt, self.attempt.entry
        target = (await self.dispatcher.retarget(first.model, first.version)
                  if self.dispatcher.retarget else (first.version, old.schema))
        if target is None:  # its breaker is open: the error goes to the client
            return False
        version, schema = target
        entry = first.model_copy(update={"request_id": f"{self.client_id}-r{self.retries + 1}",
                                         "version": version})
        stream = names.request_stream(entry.model, version, old.lane)
        try:
            queue = await self.dispatcher.enqueue(stream, entry, old.interactive, schema)
        except KvgateError:
            return False
        retry.counted(first.model, first.version, exc)
        if self.on_absorbed is not None:
            self.on_absorbed(first.version, exc)
        log.warning("request %s failed before its first token (%s); sent again as %s to %s",
                    self.request_id, exc.code, entry.request_id, version)
        self.dispatcher.release(self.request_id)
        self.attempt, self.request_id, self.queue = Attempt(stream, entry, old.interactive, schema), \
            entry.request_id, queue
        self.retries, self.last_seq, self.done, self.refused = self.retries + 1, 0, False, False
        if self.on_attempt is not None:
            await self.on_attempt(entry.request_id)
        return True

    async def _replies(self, keepalive_s: float) -> AsyncIterator[protocol.Delta | protocol.Done | None]:
        taken = 0  # replies found waiting, in a row
        while not self.done:
            remaining = self._limit() - time.time()
            if remaining <= 0:
                raise self._give_up()
            taken = taken + 1 if not self.queue.empty() else 0
            reply = await _next_reply(self.queue, min(keepalive_s, remaining), taken)
            if isinstance(reply, KvgateError):  # the reply could not be read (see _deliver)
                self.done = True
                raise reply
            if reply is KEEPALIVE or reply is RESYNC:
                for missed in await self._from_log(upto=None):
                    yield self._accept(missed)
                if reply is KEEPALIVE and not self.done:
                    yield KEEPALIVE
                continue
            if reply.seq <= self.last_seq:
                continue
            if reply.seq > self.last_seq + 1:
                for missed in await self._from_log(upto=reply.seq):
                    yield self._accept(missed)
                if reply.seq != self.last_seq + 1:
                    raise EngineFailure(f"reply stream gap: expected seq {self.last_seq + 1}, "
                                        f"got {reply.seq}, and the checkpoint log lacks it")
            yield self._accept(reply)

    def _limit(self) -> float:
        """When waiting ends: the deadline, or sooner while no token has come."""
        return self.deadline if self.tokens else min(self.deadline, self.first_token_by)

    def _give_up(self) -> RequestTimeout:
        """The 504 a passed limit ends the request with; `close` then cancels it on its worker,
        resumable or not (nobody may resume it now)."""
        self.gave_up, self.outlives_client = True, False
        if self.timeouts is None:
            return RequestTimeout("request exceeded its total time limit")
        first = not self.tokens and self.first_token_by < self.deadline
        return self.timeouts.no_first_token() if first else self.timeouts.total_passed()

    def _accept(self, reply):
        self.admitted()  # a worker took it (its first reply): off the stream's waiting line
        self.last_seq = reply.seq
        if isinstance(reply, protocol.ErrorReply):
            self.done = True
            self.refused = self.tokens == 0
            raise from_code(reply.code, reply.message, reply.param, reply.retryable)
        if isinstance(reply, protocol.Done):
            self.done = True
        else:
            self.tokens += len(reply.token_ids)
        return reply

    async def _from_log(self, upto: int | None) -> list:
        """Replies after last_seq (and before `upto`) from the worker's checkpoint log, in order."""
        try:
            raws = await self.dispatcher.redis.lrange(names.checkpoint_key(self.request_id), 0, -1)
        except Exception as exc:
            log.warning("checkpoint log unavailable for %s: %s", self.request_id, type(exc).__name__)
            return []
        found: dict[int, object] = {}
        for raw in raws:
            try:
                reply = protocol.decode_reply(raw)
            except ValueError:  # a line of a schema we do not read: the run stops short of it
                continue
            if reply.seq > self.last_seq and (upto is None or reply.seq < upto):
                found.setdefault(reply.seq, reply)
        out, want = [], self.last_seq + 1
        while want in found:  # only a contiguous run is usable
            out.append(found[want])
            want += 1
        return out

    async def aclose(self, reason: str = "client_disconnected") -> None:
        """`close` on the event loop: a response's background task (Starlette runs a sync one in a
        worker thread, where no task can be started and this process's state is not to be touched)."""
        self.close(reason)

    def close(self, reason: str = "client_disconnected") -> None:
        """The request is let go: its place on the stream given back, a cancel published unless it
        is done (or outlives its client), its queue dropped. Once: the generator's `finally` and the
        response's background task both call it."""
        if self.closed:
            return
        self.closed = True
        self.admitted()
        if not self.done and not self.outlives_client:
            self.dispatcher.cancel_soon(self.request_id, "timeout" if self.gave_up else reason)
        self.dispatcher.release(self.request_id)


class LogFollower(Handle):
    """The replies of a request being resumed, read from its reply log: the worker publishes to the
    channel of the gateway that dispatched it, which may be gone, and appends every reply to the
    log as it publishes it. The log only grows, so each read fetches only the lines not yet read.
    It reads when the worker publishes a step (this gateway listens on `channel`, the dispatching
    gateway's, for as long as it follows), and every FOLLOW_WAKE_S in case it missed one
    (FOLLOW_POLL_S when the channel is unknown: a lease written before it was kept)."""

    def __init__(self, dispatcher: Dispatcher, request_id: str, deadline: float, channel: str | None = None):
        super().__init__(dispatcher, request_id, asyncio.Queue(), deadline)
        self.channel = channel
        self._waker: asyncio.Event | None = None
        self._read = 0  # lines of the log read so far
        self._truncated = False  # the worker stopped appending deltas (KVGATE_MAX_CHECKPOINT_BYTES)

    async def replies(self, keepalive_s: float) -> AsyncIterator[protocol.Delta | protocol.Done | None]:
        self._waker = waker = await self.dispatcher.watch(self.channel, self.request_id)
        every = FOLLOW_WAKE_S if self.channel else FOLLOW_POLL_S
        quiet = time.monotonic()
        try:
            while not self.done:
                if time.time() >= self.deadline:
                    raise self._give_up()
                waker.clear()  # a step published from here on wakes the wait below
                fresh = await self._tail()
                for reply in fresh:
                    yield self._accept(reply)
                if fresh:
                    quiet = time.monotonic()
                elif time.monotonic() - quiet >= keepalive_s:
                    quiet = time.monotonic()
                    yield KEEPALIVE
                else:
                    wait = min(every, keepalive_s - (time.monotonic() - quiet), self.deadline - time.time())
                    try:
                        await asyncio.wait_for(waker.wait(), timeout=max(wait, 0.001))
                    except asyncio.TimeoutError:
                        pass
        finally:
            self.dispatcher.unwatch(self.channel, self.request_id, waker)

    def close(self, reason: str = "client_disconnected") -> None:
        if self._waker is not None and not self.closed:  # the generator's own finally may run later
            self.dispatcher.unwatch(self.channel, self.request_id, self._waker)
        super().close(reason)

    async def _tail(self) -> list:
        """The log's new replies after last_seq, in order, at most LOG_PAGE of them (the next read
        comes at once, after the event loop's turn: replaying a finished stream of 16 choices of
        2,000 tokens in one read held the loop, every other stream of this gateway with it, for
        ~0.3 s); a gap (a truncated log) raises."""
        if self._read:
            await asyncio.sleep(0)
        try:
            raws = await self.dispatcher.redis.lrange(names.checkpoint_key(self.request_id), self._read,
                                                      self._read + LOG_PAGE - 1)
        except Exception as exc:  # Redis away: the deadline bounds the wait
            log.warning("reply log unavailable for %s: %s", self.request_id, type(exc).__name__)
            await asyncio.sleep(FOLLOW_POLL_S * 10)
            return []
        self._read += len(raws)
        out, want = [], self.last_seq + 1
        for raw in raws:
            try:
                reply = protocol.decode_reply(raw)
            except ValueError:  # a line of a schema this gateway does not read: a gap below
                continue
            if reply.seq == 0:
                self._truncated = True
            elif reply.seq == want:
                out.append(reply)
                want += 1
            elif reply.seq > want:
                raise ResumeFailed(f"the reply log of {self.request_id} lacks sequence {want}"
                                   f"{' (it reached KVGATE_MAX_CHECKPOINT_BYTES)' if self._truncated else ''}"
                                   "; send the request again", retry_after=1)
        return out


TAKEN_IN_A_ROW = 32  # replies a stream takes from its queue before it lets the event loop run


async def _next_reply(queue: asyncio.Queue, timeout: float, taken: int):
    """The next reply, or KEEPALIVE after `timeout` of silence (maybe replies were lost while the
    subscription reconnected). One already queued is taken at once, without a turn of the event
    loop (`wait_for` wrapped each get in a task of its own, for every token of every stream),
    except every TAKEN_IN_A_ROW-th in a row (`taken`), so a long backlog does not hold the loop."""
    if not queue.empty():
        if taken % TAKEN_IN_A_ROW == 0:
            await asyncio.sleep(0)
        if not queue.empty():
            return queue.get_nowait()
    try:
        async with asyncio.timeout(timeout):
            return await queue.get()
    except TimeoutError:
        return KEEPALIVE


def _nothing() -> None:
    return None


class Lookahead:
    """A request's replies with the first one awaited before the response starts: a streamed
    response sends its 200 only once the worker has admitted the request (its first reply, the
    empty admission delta) or the wait is over, so a refusal before that is an HTTP error."""

    def __init__(self, replies: AsyncIterator):
        self._replies = replies
        self._first = None
        self._pending: asyncio.Task | None = None

    async def wait_first(self, timeout: float, gone: asyncio.Future) -> bool:
        """Until the first reply that is not a keep-alive, or `timeout`; a refusal raises. False
        as soon as `gone` is done (the client left)."""
        deadline = time.monotonic() + timeout
        while self._first is None and (left := deadline - time.monotonic()) > 0:
            if self._pending is None:
                self._pending = asyncio.create_task(self._next())
            await asyncio.wait({self._pending, gone}, timeout=left,
                               return_when=asyncio.FIRST_COMPLETED)
            if gone.done():
                return False
            if self._pending.done():
                task, self._pending = self._pending, None
                if (reply := task.result()) is not KEEPALIVE:
                    self._first = reply
        return True

    def cancel(self) -> None:
        if self._pending is not None:
            self._pending.cancel()

    async def _next(self):
        return await anext(self._replies)

    async def __aiter__(self):
        if self._first is not None:
            yield self._first
        if self._pending is not None:  # the wait ended before the first reply: it comes here
            task, self._pending = self._pending, None
            try:
                yield await task
            except StopAsyncIteration:
                return
        async for reply in self._replies:
            yield reply
