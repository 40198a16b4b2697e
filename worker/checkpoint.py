"""The checkpoint of a request is the log of the replies its worker published (a Redis list with a
TTL, appended in the same pipeline as each PUBLISH). A worker that takes an orphaned request over
folds it to learn where to resume; a gateway that saw a sequence gap replays the missing replies.

A log is bounded (`KVGATE_MAX_CHECKPOINT_BYTES` per request): past the cap the worker appends no
more deltas, only one marker line, so a takeover knows the log is incomplete and answers the request
with `resume_failed` instead of resuming it from a wrong place. The marker is a reply with sequence
number 0, which numbers no real reply, so every reader of the log (this one, the gateway's gap
repair, a worker or gateway of the previous release) decodes it and skips it. The last reply (done
or error) is always appended, so a takeover after the end still sees the end.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import redis

from shared import names, protocol

log = logging.getLogger("kvgate.worker")

TTL_S = 600  # while the request runs; refreshed every step
DONE_TTL_S = 60  # after the request ended: long enough for a gateway to fill a last gap
TRUNCATED = "checkpoint_truncated"  # the marker line's finish_reason


@dataclass
class Checkpoint:
    last_seq: int = 0
    tokens: dict[int, list[int]] = field(default_factory=dict)  # choice index → emitted token ids
    text: dict[int, str] = field(default_factory=dict)  # choice index → released text
    finished: dict[int, str] = field(default_factory=dict)  # choice index → finish reason
    done: bool = False
    truncated: bool = False  # the log hit its cap: replies after some point are missing
    unreadable: int = 0  # lines this process cannot decode (another schema version, garbage)
    size: int = 0  # bytes in the log

    @property
    def empty(self) -> bool:
        return self.last_seq == 0

    @property
    def resumable(self) -> bool:
        """Whether the log tells exactly where the request stands."""
        return not self.truncated and not self.unreadable

    def fold(self, reply: protocol.Delta | protocol.Done | protocol.ErrorReply) -> None:
        if reply.seq == 0:
            self.truncated = True
            return
        if reply.seq <= self.last_seq:  # a pipeline retried after a dropped connection
            return
        self.last_seq = reply.seq
        if isinstance(reply, protocol.Delta):
            self.tokens.setdefault(reply.index, []).extend(reply.token_ids)
            self.text[reply.index] = self.text.get(reply.index, "") + reply.text
            if reply.finish_reason:
                self.finished[reply.index] = reply.finish_reason
        else:
            self.done = True


def load(client: redis.Redis, request_id: str) -> Checkpoint:
    """The folded log; a line that does not decode is counted, never raised (a worker of another
    version may have written it, and a takeover must not crash on it)."""
    ckpt = Checkpoint()
    for raw in client.lrange(names.checkpoint_key(request_id), 0, -1):
        ckpt.size += len(raw)
        try:
            ckpt.fold(protocol.decode_reply(raw))
        except ValueError:  # ProtocolError and pydantic's ValidationError both are
            ckpt.unreadable += 1
    if ckpt.unreadable:
        log.warning("checkpoint of %s has %d unreadable lines", request_id, ckpt.unreadable,
                    extra={"request_id": request_id})
    return ckpt


class LogCap:
    """Bytes appended to each request's log by this worker; past the cap only the marker, once."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.sizes: dict[str, int] = {}  # request id → bytes in its log; -1: truncated

    def start(self, request_id: str, size: int) -> None:
        """A taken-over request's log already holds `size` bytes."""
        self.sizes[request_id] = size

    def lines(self, reply: protocol.Delta | protocol.Done | protocol.ErrorReply, raw: bytes,
              version: int | None = None) -> list[bytes]:
        """What to append to the log for `reply` (encoded as `raw`): itself, or the marker the first
        time the cap is passed, or nothing after that; the last reply always."""
        size = self.sizes.get(reply.request_id, 0)
        if not isinstance(reply, protocol.Delta):
            return [raw]
        if size < 0:
            return []
        if size + len(raw) <= self.max_bytes:
            self.sizes[reply.request_id] = size + len(raw)
            return [raw]
        self.sizes[reply.request_id] = -1
        log.warning("checkpoint of %s reached %d bytes: no longer appended (a takeover answers "
                    "resume_failed)", reply.request_id, self.max_bytes,
                    extra={"request_id": reply.request_id})
        marker = protocol.Delta(request_id=reply.request_id, seq=0, finish_reason=TRUNCATED)
        return [protocol.encode(marker, version)]

    def forget(self, request_id: str) -> None:
        self.sizes.pop(request_id, None)
