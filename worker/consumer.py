"""The stream consumer: which entries of its two lanes (interactive and batch) this worker admits next.

An entry arrives three ways: read by the flush that sends a step's replies, claimed from a worker whose
heartbeat lapsed (worker/takeover.py), or, when the engine is idle, by a short blocking read of both
lanes. What was taken and not yet admitted waits in the backlog, and survives a Redis error:
admission goes on when Redis answers again. The batch lane is read only when the interactive one
came back short, and its entries are admitted after every interactive one.

Two orders (KVGATE_FAIR_ORDER): FIFO reads only as many entries as the engine has room for and admits
them oldest first; the fair order (worker/fairness.py) reads ahead, up to KVGATE_FAIR_LOOKAHEAD entries
per lane, so it can choose, and admits the best priority, then the least-served tenant, then the
oldest. Entries in the backlog are still pending in Redis under this worker's name (read, not
acknowledged): a crash loses none of them (takeover claims them), and they still count in the
stream's length, which is what the gateway's depth bound sheds on.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import redis

from shared import names, protocol
from shared.settings import WorkerSettings
from worker.fairness import Claim, FairOrder, claim_of
from worker.takeover import claim_orphans


@dataclass
class PendingEntry:
    """A stream entry this worker was handed and has not admitted yet."""

    stream: str
    entry_id: bytes
    raw: bytes
    times_delivered: int = 0  # to workers before this one claimed it; 0: read fresh
    claim: Claim = field(default_factory=Claim)  # its tenant and priority (read under the fair order)
    arrival: int = 0  # when it joined the backlog: smaller is older


def read_entries(reply) -> list[PendingEntry]:
    """The entries of an XREADGROUP reply."""
    return [PendingEntry(name.decode() if isinstance(name, bytes) else name, entry_id,
                         fields.get(protocol.ENTRY_FIELD, b""))
            for name, entries in reply or [] for entry_id, fields in entries]


# while a flush has nothing to send (a whole answer's deltas are held: worker/held.py), the lanes
# are read at most this often, so steps faster than a Redis round trip do not each wait for one
READ_EVERY_S = 0.001


class StreamConsumer:
    def __init__(self, client: redis.Redis, s: WorkerSettings, order: FairOrder | None = None):
        """`order`: the fair order's counters; None: FIFO."""
        self.client, self.s, self.order = client, s, order
        self.last_read = 0.0  # time.monotonic() of the last read of the lanes (blocking or a flush's)
        self.stream = names.request_stream(s.served_name, s.version)
        self.batch_stream = names.request_stream(s.served_name, s.version, names.BATCH_LANE)
        self.backlog: list[PendingEntry] = []  # taken, not yet admitted
        self.arrivals = itertools.count()
        self.last_claim = 0.0
        self.interactive_drained = True  # the last read of the interactive lane left nothing

    def ensure_groups(self) -> None:
        for stream in (self.stream, self.batch_stream):
            try:
                self.client.xgroup_create(stream, names.CONSUMER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def take(self, room: int, idle: bool, known: Callable[[], set[bytes]]) -> None:
        """Fill the backlog for `room` admissions: orphans (once a heartbeat); when the engine is
        `idle` and nothing waits, a short blocking read of both lanes. `known`: the entry ids the
        engine holds (asked only when claiming). Then `next()` hands them out one at a time."""
        if room <= 0:
            return
        if self._claim_due():
            # FIFO claims only room the backlog leaves; the fair order claims anyway, so a full
            # look-ahead never keeps a dead worker's requests waiting
            count = room if self.order else room - len(self.backlog)
            held = known() | {p.entry_id for p in self.backlog}
            for stream in (self.stream, self.batch_stream):
                self._join(self._orphans(stream, count, held))
        if not self.backlog and idle:
            # one entry from each lane at most, the surplus waits its turn
            self._join(read_entries(self.client.xreadgroup(
                names.CONSUMER_GROUP, self.s.worker_id, {self.stream: ">", self.batch_stream: ">"},
                count=1, block=100)))
            self.last_read = time.monotonic()

    def next(self, fits: Callable[[PendingEntry], bool] | None = None) -> PendingEntry | None:
        """The entry to admit now, out of the backlog (hand it back with `put_back` if Redis fails
        before it is admitted): interactive first, then FIFO's oldest or the fair order's choice;
        only among those that `fits`, when given."""
        among = [i for i, p in enumerate(self.backlog) if fits is None or fits(p)]
        if not among:
            return None
        best = min(among, key=lambda i: self._rank(self.backlog[i]))
        return self.backlog.pop(best)

    def peek(self) -> PendingEntry | None:
        """The entry `next()` would hand out, left in the backlog."""
        return min(self.backlog, key=self._rank, default=None)

    def lane(self, stream: str | None) -> int:
        """0: the interactive lane (or unknown), 1: the batch lane."""
        return int(stream == self.batch_stream)

    def put_back(self, entries: list[PendingEntry]) -> None:
        """Entries taken and not admitted (Redis failed meanwhile): they keep their place in line."""
        self.backlog = entries + self.backlog

    def _rank(self, p: PendingEntry) -> tuple:
        lane = self.lane(p.stream)
        return (lane, p.arrival) if self.order is None else self.order.rank(p.claim, lane, p.arrival)

    def _join(self, entries: list[PendingEntry]) -> None:
        """Entries join the backlog in arrival order; under the fair order each is read for its
        tenant, and a tenant that had no work here is lifted to the others' level."""
        active = self.order.active(p.claim for p in self.backlog) if self.order and entries else set()
        for p in entries:
            p.arrival = next(self.arrivals)
            if self.order is not None:
                p.claim = claim_of(p.raw)
                self.order.lift(p.claim.tenant, active)
                active.add(p.claim.tenant)
            self.backlog.append(p)

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

    def next_reads(self, room: int, yielding: bool = False, quiet: bool = False) -> list[tuple[str, int]]:
        """What the next flush reads, only when the engine has `room` (an entry read when none can
        start would wait here instead of in the stream, where another worker could take it) or, under
        the fair order on an engine whose tenants can be made to yield a slot (`yielding`), always:
        an entry of a tenant below its share starts in a full batch. FIFO reads that room, less the
        backlog; the fair order fills each lane's look-ahead to KVGATE_FAIR_LOOKAHEAD (or the room,
        if more). The batch lane is read when the interactive lane's last read came back short (the
        engine's priorities keep it behind, too). A `quiet` flush (nothing to send) reads nothing
        within READ_EVERY_S of the last read, the idle blocking one included: its round trip would
        be the only one, and a whole answer's first step would wait for it."""
        if room <= 0 and not (yielding and self.order is not None):
            return []
        if quiet and time.monotonic() - self.last_read < READ_EVERY_S:
            return []
        if self.order is None:
            want = dict.fromkeys((self.stream, self.batch_stream), room - len(self.backlog))
        else:
            bound = max(room, self.s.fair_lookahead)
            want = {lane: bound - sum(p.stream == lane for p in self.backlog)
                    for lane in (self.stream, self.batch_stream)}
        reads = [(self.stream, want[self.stream])]
        if self.interactive_drained:
            reads.append((self.batch_stream, want[self.batch_stream]))
        return [(stream, count) for stream, count in reads if count > 0]

    def received(self, reads: Sequence[tuple[str, int]], replies: Sequence) -> None:
        """The flush's replies to `reads` join the backlog (admitted before the next step)."""
        if reads:
            self.last_read = time.monotonic()
        for (stream, count), reply in zip(reads, replies):
            entries = read_entries(reply)
            self._join(entries)
            if stream == self.stream:
                self.interactive_drained = len(entries) < count
