"""The stream consumer: which entries of its two lanes (interactive and batch) this worker admits next.

An entry arrives three ways: read by the flush that sends a step's replies (as many as the engine has
room for; the batch lane only when the interactive one came back short), claimed from a worker whose
heartbeat lapsed (worker/takeover.py), or, when the engine is idle, by a short blocking read of both
lanes. What was taken and not yet admitted waits in the backlog, interactive entries first, and
survives a Redis error: admission goes on when Redis answers again.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis

from shared import names, protocol
from shared.redis_errors import REDIS_ERRORS
from shared.settings import WorkerSettings
from worker.takeover import claim_orphans


@dataclass
class PendingEntry:
    """A stream entry this worker was handed and has not admitted yet."""

    stream: str
    entry_id: bytes
    raw: bytes
    times_delivered: int = 0  # to workers before this one claimed it; 0: read fresh


def read_entries(reply) -> list[PendingEntry]:
    """The entries of an XREADGROUP reply."""
    return [PendingEntry(name.decode() if isinstance(name, bytes) else name, entry_id,
                         fields.get(protocol.ENTRY_FIELD, b""))
            for name, entries in reply or [] for entry_id, fields in entries]


class StreamConsumer:
    def __init__(self, client: redis.Redis, s: WorkerSettings):
        self.client, self.s = client, s
        self.stream = names.request_stream(s.served_name, s.version)
        self.batch_stream = names.request_stream(s.served_name, s.version, names.BATCH_LANE)
        self.backlog: list[PendingEntry] = []  # taken, not yet admitted
        self.last_claim = 0.0
        self.interactive_drained = True  # the last read of the interactive lane left nothing

    def ensure_groups(self) -> None:
        for stream in (self.stream, self.batch_stream):
            try:
                self.client.xgroup_create(stream, names.CONSUMER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def take(self, room: int, idle: bool, known: Callable[[], set[bytes]]) -> list[PendingEntry]:
        """Up to `room` entries to admit now: the backlog's, then orphans (once a heartbeat); when the
        engine is `idle` and nothing waits, block on both lanes a while. `known`: the entry ids the
        engine holds (asked only when claiming). Hand back with `put_back` what is not admitted."""
        todo, self.backlog = self.backlog[:room], self.backlog[room:]
        try:
            if len(todo) < room and self._claim_due():
                held = known() | {p.entry_id for p in todo + self.backlog}
                for stream in (self.stream, self.batch_stream):
                    todo += self._orphans(stream, room - len(todo), held)
            if not todo and room and idle:
                # one entry from each lane at most, the surplus waits its turn
                read = read_entries(self.client.xreadgroup(
                    names.CONSUMER_GROUP, self.s.worker_id, {self.stream: ">", self.batch_stream: ">"},
                    count=1, block=100))
                todo, self.backlog = read[:room], read[room:] + self.backlog
        except REDIS_ERRORS:  # what was taken waits for Redis
            self.put_back(todo)
            raise
        return todo

    def put_back(self, entries: list[PendingEntry]) -> None:
        """Entries taken and not admitted (Redis failed meanwhile): first in line next time."""
        self.backlog = entries + self.backlog

    def _claim_due(self) -> bool:
        """Orphans are looked for once a heartbeat, not every step (XPENDING is a round trip)."""
        if time.monotonic() - self.last_claim < self.s.heartbeat_s:
            return False
        self.last_claim = time.monotonic()
        return True

    def _orphans(self, stream: str, count: int, held: set[bytes]) -> list[PendingEntry]:
        orphans = claim_orphans(self.client, stream, self.s.worker_id, int(self.s.heartbeat_ttl_s * 1000),
                                count, held)
        return [PendingEntry(stream, o.entry_id, o.raw, o.times_delivered) for o in orphans]

    def next_reads(self, room: int) -> list[tuple[str, int]]:
        """What the next flush reads: as many new entries as the engine has `room` for, less the
        backlog. The batch lane gets only the room the interactive lane leaves: it is read when the
        interactive lane's last read came back short (the engine's priorities keep it behind, too)."""
        room -= len(self.backlog)
        if room <= 0:
            return []
        return [(self.stream, room)] + ([(self.batch_stream, room)] if self.interactive_drained else [])

    def received(self, reads: Sequence[tuple[str, int]], replies: Sequence) -> None:
        """The flush's replies to `reads` join the backlog (admitted before the next step)."""
        for (stream, count), reply in zip(reads, replies):
            entries = read_entries(reply)
            self.backlog += entries
            if stream == self.stream:
                self.interactive_drained = len(entries) < count
        self.backlog.sort(key=lambda p: p.stream != self.stream)  # interactive entries first
