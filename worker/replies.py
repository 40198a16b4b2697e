"""The worker's outbox: one engine step's replies as Redis commands, sent in one pipeline.

Every reply is PUBLISHed and then appended to the request's checkpoint log (publish first: if the
worker dies in between, the resuming worker re-sends that sequence number and the gateway drops
the duplicate). A step's replies to one gateway go in one message, and a log's TTL is refreshed
every TTL_REFRESH replies rather than on each, so a step of 64 streams costs ~65 commands, not 192.
The worker's next reads ride in the same pipeline: one round trip per engine step, which is most of
a step's cost when the engine is fast (Redis shares the machine's cores). While Redis is unreachable the commands are kept and retried, and the worker does
not step further, so a short outage loses no token.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import redis

from shared import names, protocol
from worker import checkpoint

log = logging.getLogger("kvgate.worker")


TTL_REFRESH = 32  # replies between refreshes of a log's TTL (first at reply 1: the log is new)


class Outbox:
    def __init__(self, client: redis.Redis, stream: str, consumer: str,
                 max_log_bytes: int = 4 << 20):
        self.client = client
        self.logs = checkpoint.LogCap(max_log_bytes)  # what each request's log may still take
        self.stream = stream
        self.consumer = consumer  # this worker's name in the streams' consumer group
        self.outgoing: dict[str, list[bytes]] = {}  # reply channel -> this step's encoded replies
        self.ops: list[tuple] = []  # after the PUBLISHes: logs, TTLs, acks

    def reply(self, channel: str, msg: protocol.Delta | protocol.Done | protocol.ErrorReply,
              version: int | None = None) -> None:
        """`version`: the schema of the request's entry, so a gateway of that version reads it."""
        raw = protocol.encode(msg, version)
        key = names.checkpoint_key(msg.request_id)
        self.outgoing.setdefault(channel, []).append(raw)
        self.ops += [("rpush", key, line) for line in self.logs.lines(msg, raw, version)]
        if msg.seq % TTL_REFRESH == 1:
            self.ops.append(("expire", key, checkpoint.TTL_S))

    def finish(self, entry_id: bytes, request_id: str, stream: str | None = None) -> None:
        """The request is over: the entry leaves the stream, its log stays briefly for gap repair."""
        self.ack(entry_id, stream)
        self.ops.append(("expire", names.checkpoint_key(request_id), checkpoint.DONE_TTL_S))
        self.logs.forget(request_id)

    def ack(self, entry_id: bytes, stream: str | None = None) -> None:
        """`stream`: the entry's own (a worker reads two lanes); None: the one it was made with."""
        stream = stream or self.stream
        self.ops += [("xack", stream, names.CONSUMER_GROUP, entry_id), ("xdel", stream, entry_id)]

    def flush(self, reads: Sequence[tuple[str, int]] = ()) -> list | None:
        """Send everything queued, then read up to `count` new entries of each (stream, count) in
        `reads` (without blocking) in the same round trip. The reads' replies, in order; None, and
        everything kept, if Redis is unreachable."""
        if not self.ops and not self.outgoing and not reads:
            return []
        pipe = self.client.pipeline(transaction=False)
        for channel, raws in self.outgoing.items():
            pipe.publish(channel, protocol.encode_replies(raws))
        for name, *args in self.ops:
            getattr(pipe, name)(*args)
        for stream, count in reads:
            pipe.xreadgroup(names.CONSUMER_GROUP, self.consumer, {stream: ">"}, count=count)
        try:
            results = pipe.execute(raise_on_error=False)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("replies held while Redis is unreachable (%s)", type(exc).__name__)
            return None
        self.outgoing.clear()  # Redis ran every command: none is sent twice
        self.ops.clear()
        if errors := [r for r in results if isinstance(r, Exception)]:
            raise errors[0]  # e.g. NOGROUP: Redis lost the streams; the worker makes them again
        return results[len(results) - len(reads):]
