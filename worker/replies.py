"""The worker's outbox: one engine step's replies as Redis commands, sent in one pipeline.

Every reply is PUBLISHed and then appended to the request's checkpoint log (publish first: if the
worker dies in between, the resuming worker re-sends that sequence number and the gateway drops
the duplicate). A step's replies to one gateway go in one message, and a log's TTL is refreshed
every TTL_REFRESH replies rather than on each, so a step of 64 streams costs ~65 commands, not 192.
The worker's next reads ride in the same pipeline: one round trip per engine step, which is most of
a step's cost when the engine is fast (Redis shares the machine's cores); a loop that admitted a
stream flushes its verdict once more, before a step that takes longer than that round trip
(worker/service.py).

While Redis refuses (unreachable, full, read-only, not saving, loading: shared/redis_errors.py) the
commands it refused are kept, in order, and sent first by the next flush; the worker does not step
further meanwhile, so a refusal loses no token. Commands that ran are never sent again, and one that
failed for good (NOGROUP: the stream is gone, so is the entry to ack; WRONGTYPE) is dropped.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import redis

from shared import errors, names, protocol
from shared.redis_client import is_cluster
from shared.redis_errors import REDIS_ERRORS, refusal
from worker import checkpoint

log = logging.getLogger("kvgate.worker")


TTL_REFRESH = 32  # replies between refreshes of a log's TTL (first at reply 1: the log is new)
RETRYABLE = {errors.EngineStepFailed.code, errors.ResumeFailed.code}  # sent again, may succeed


class Outbox:
    def __init__(self, client: redis.Redis, stream: str, consumer: str,
                 max_log_bytes: int = 4 << 20):
        self.client = client
        self.logs = checkpoint.LogCap(max_log_bytes)  # what each request's log may still take
        self.stream = stream
        self.consumer = consumer  # this worker's name in the streams' consumer group
        self.outgoing: dict[str, list[bytes]] = {}  # reply channel -> this step's encoded replies
        self.ops: list[tuple] = []  # after the PUBLISHes: logs, TTLs, acks
        self.refused: list[tuple] = []  # commands Redis refused for now, in order: sent first next flush
        self.cluster = is_cluster(client)  # a cluster pipeline refuses PUBLISH: sent on its own
        self.round_trip_s = 0.0  # how long the last flush that sent anything took

    @property
    def empty(self) -> bool:
        """Nothing to send (a flush without reads would be no round trip)."""
        return not (self.refused or self.outgoing or self.ops)

    def reply(self, channel: str, msg: protocol.Delta | protocol.Done | protocol.ErrorReply,
              version: int | None = None) -> None:
        """`version`: the schema of the request's entry, so a gateway of that version reads it."""
        raw = protocol.encode(msg, version)
        key = names.checkpoint_key(msg.request_id)
        self.outgoing.setdefault(channel, []).append(raw)
        self.ops += [("rpush", key, line) for line in self.logs.lines(msg, raw, version)]
        if msg.seq % TTL_REFRESH == 1:
            self.ops.append(("expire", key, checkpoint.TTL_S))

    def error(self, channel: str, request_id: str, seq: int, version: int, code: str, message: str,
              param: str | None = None) -> None:
        """An error reply; the gateway may offer a retry when its code says sending again may work."""
        self.reply(channel, protocol.ErrorReply(request_id=request_id, seq=seq, code=code, message=message,
                                                param=param, retryable=code in RETRYABLE), version)

    def finish(self, entry_id: bytes, request_id: str, stream: str | None = None) -> None:
        """The request is over: the entry leaves the stream, its log stays briefly for gap repair."""
        self.ack(entry_id, stream)
        self.ops.append(("expire", names.checkpoint_key(request_id), checkpoint.DONE_TTL_S))
        self.logs.forget(request_id)

    def ack(self, entry_id: bytes, stream: str | None = None) -> None:
        """`stream`: the entry's own (a worker reads two lanes); None: the one it was made with."""
        stream = stream or self.stream
        self.ops += [("xack", stream, names.CONSUMER_GROUP, entry_id), ("xdel", stream, entry_id)]

    def acking(self) -> set[bytes]:
        """Entry ids whose acknowledgement is queued, not yet sent: still pending in Redis, but
        over (a claim of this worker's lost entries must not take them back)."""
        return {command[3] for command in self.refused + self.ops if command[0] == "xack"}

    def flush(self, reads: Sequence[tuple[str, int]] = ()) -> list | None:
        """Send what Redis refused before, then everything queued, then read up to `count` new
        entries of each (stream, count) in `reads` (without blocking), in one round trip. The
        reads' replies in order (None for a read Redis refused), or None if Redis did not answer at
        all. Whatever Redis refused for now is in `refused` afterwards; a NOGROUP read raises
        (after the rest ran)."""
        was_refused = bool(self.refused)
        commands = self.refused + [("publish", channel, protocol.encode_replies(raws))
                                for channel, raws in self.outgoing.items()] + self.ops
        self.refused, self.ops = [], []
        self.outgoing.clear()
        if not commands and not reads:
            return []
        started = time.perf_counter()
        try:
            results = self._execute(commands, reads)
        except REDIS_ERRORS as exc:  # no answer at all: resent whole (a duplicate is harmless)
            self._hold(commands, commands, exc, was_refused)
            return None
        self.round_trip_s = time.perf_counter() - started
        refused = [(c, r) for c, r in zip(commands, results) if isinstance(r, Exception)]
        self._hold([c for c, r in refused if refusal(r) is not None], commands,
                   refused[0][1] if refused else None, was_refused)
        for command, error in refused:
            if refusal(error) is None:  # will never succeed: resending would only block the rest
                log.warning("dropped %s %s: %s", command[0], command[1], error)
        replies = results[len(commands):]
        for reply in replies:
            if isinstance(reply, redis.ResponseError) and "NOGROUP" in str(reply):
                raise reply  # Redis lost the streams; the worker makes them again
        return [None if isinstance(r, Exception) else r for r in replies]

    def _execute(self, commands: list[tuple], reads: Sequence[tuple[str, int]]) -> list:
        """The results of `commands`, then of `reads`, in order. On a cluster the PUBLISHes go first,
        each on its own (redis-py's cluster pipeline refuses them), so a reply is still published
        before it is logged; one that gets no answer raises before anything else is sent."""
        direct = [i for i, (name, *_) in enumerate(commands) if self.cluster and name == "publish"]
        published = {i: self.client.publish(*commands[i][1:]) for i in direct}
        pipe = self.client.pipeline(transaction=False)
        for i, (name, *args) in enumerate(commands):
            if i not in published:
                getattr(pipe, name)(*args)
        for stream, count in reads:
            pipe.xreadgroup(names.CONSUMER_GROUP, self.consumer, {stream: ">"}, count=count)
        piped = iter(pipe.execute(raise_on_error=False))
        return [published[i] if i in published else next(piped) for i in range(len(commands))] + list(piped)

    def _hold(self, held: list[tuple], sent: list[tuple], error: Exception | None, was_refused: bool) -> None:
        """Keep what Redis refused; say so when holding starts and ends, not on every retry."""
        self.refused = held
        if held and not was_refused:
            log.warning("Redis refused %d of %d commands (%s); holding them and retrying",
                        len(held), len(sent), refusal(error) or type(error).__name__)
        elif was_refused and not held:
            log.info("Redis took the held commands again")
