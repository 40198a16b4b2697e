"""A key's share of a model's queue: at most KVGATE_FAIR_QUEUE_PER_KEY of one key's interactive
requests wait on a version's stream (sent by this gateway, not yet admitted by a worker); the key's
next request waits here until one of them is admitted; waiting requests go on in the engine's order
(`priority`, lower first, then arrival), so a key's urgent request is not stuck behind its own
bulk.

Why: the worker's fair order (worker/fairness.py) chooses among the entries it reads ahead, at most
KVGATE_FAIR_LOOKAHEAD per lane. A tenant flooding a model at several times its capacity would
otherwise put hundreds of entries on the stream ahead of everyone else's, beyond any look-ahead,
and a light tenant's request would wait behind all of them whatever the order. With the gate, the
stream holds at most this many of any key's requests per gateway, so another tenant's request is
never more than (backlogged keys × gateways × this) entries from the head: within the look-ahead
for a handful of flooding keys. Waiting is bounded too: a key with more than KVGATE_MAX_STREAM_DEPTH
requests waiting here gets the stream's own 503. Local to a gateway process: nothing to recover if
it dies (its waiting requests die with it, unsent).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.metrics import QUEUE_GATE_WAITING
from shared.errors import Overloaded


@dataclass
class _Line:
    free: int  # places on the stream not held
    waiters: list[tuple[int, int, asyncio.Future]] = field(default_factory=list)  # a heap
    users: int = 0  # waiting or holding: the line is dropped when none is left
    waiting: int = 0


class QueueGate:
    def __init__(self, per_key: int, max_waiting: int):
        self.per_key = per_key  # 0: no gate
        self.max_waiting = max_waiting
        self._lines: dict[tuple[str, str], _Line] = {}
        self._arrivals = itertools.count()

    def open_now(self, key_id: str | None, stream: str) -> bool:
        """Whether `enter` would give a place at once (without waiting)."""
        if self.per_key <= 0 or key_id is None:
            return True
        line = self._lines.get((key_id, stream))
        return line is None or (line.free > 0 and not line.waiting)

    async def enter(self, key_id: str | None, stream: str, model: str, timeout: float,
                    on_timeout: Callable[[], Exception], priority: int = 0) -> Callable[[], None]:
        """A place on `stream` for one of `key_id`'s requests; what to call (once; later calls do
        nothing) when the request is admitted or ends. Raises on_timeout() if none came in time."""
        if self.per_key <= 0 or key_id is None:
            return _nothing
        where = (key_id, stream)
        line = self._lines.get(where)
        if line is None:
            line = self._lines[where] = _Line(free=self.per_key)
        if line.free > 0 and not line.waiting:
            line.free -= 1
            line.users += 1
            return self._releaser(where, line)
        if line.waiting >= self.max_waiting:
            raise Overloaded(f"this key has {line.waiting} requests waiting for model '{model}' "
                             f"on this gateway, its limit (KVGATE_MAX_STREAM_DEPTH); retry shortly",
                             retry_after=2)
        turn = asyncio.get_running_loop().create_future()
        heapq.heappush(line.waiters, (priority, next(self._arrivals), turn))
        line.users += 1
        line.waiting += 1
        QUEUE_GATE_WAITING.inc()
        try:
            await asyncio.wait_for(turn, None if math.isinf(timeout) else max(timeout, 0.001))
        except BaseException as exc:
            if turn.done() and not turn.cancelled():  # its place came as it left: pass it on
                self._hand_on(line)
            self._leave(where, line)
            if isinstance(exc, asyncio.TimeoutError):
                raise on_timeout() from None
            raise
        finally:
            line.waiting -= 1
            QUEUE_GATE_WAITING.dec()
        return self._releaser(where, line)

    def _releaser(self, where: tuple[str, str], line: _Line) -> Callable[[], None]:
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self._hand_on(line)
                self._leave(where, line)
        return release

    def _hand_on(self, line: _Line) -> None:
        """A place given back goes to the first waiter still waiting, or is free."""
        while line.waiters:
            turn = heapq.heappop(line.waiters)[2]
            if not turn.done():
                turn.set_result(None)
                return
        line.free += 1

    def _leave(self, where: tuple[str, str], line: _Line) -> None:
        line.users -= 1
        if line.users == 0 and self._lines.get(where) is line:
            del self._lines[where]

    def waiting(self) -> int:
        """Requests waiting in this gateway for a place on a stream (a gauge)."""
        return sum(line.waiting for line in self._lines.values())


def _nothing() -> None:
    return None
