"""Requests waiting for their grammar: outside the scheduler, so the batch goes on without them, and
each leaves with its compiled grammar, or with the error that ends it (a spec xgrammar refused, or
a compile past structured_compile_timeout_s: that thread may still finish, the request does not
wait for it)."""
from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from worker.engine.base import request_error
from worker.engine.sequence import Sequence, SequenceStatus
from worker.engine.structured import CODE, PARAM, timed_out
from worker.engine.types import RequestError


@dataclass
class Waiting:
    future: Future
    deadline: float  # time.monotonic()
    seqs: list[Sequence]


class CompilingRequests:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._waiting: dict[str, Waiting] = {}

    def __bool__(self) -> bool:
        return bool(self._waiting)

    @property
    def num_seqs(self) -> int:
        return sum(len(w.seqs) for w in self._waiting.values())

    def add(self, request_id: str, future: Future, seqs: list[Sequence]) -> None:
        for seq in seqs:
            seq.status = SequenceStatus.COMPILING
        self._waiting[request_id] = Waiting(future, time.monotonic() + self.timeout_s, seqs)

    def remove(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def settled(self) -> list[tuple[list[Sequence], object | RequestError]]:
        """The requests whose compile ended or timed out, each with its grammar or its error."""
        now, out = time.monotonic(), []
        for request_id, w in list(self._waiting.items()):
            if w.future.done():
                out.append((w.seqs, _result(request_id, w.future)))
            elif now >= w.deadline:
                out.append((w.seqs, RequestError(CODE, timed_out(self.timeout_s), param=PARAM)))
            else:
                continue
            del self._waiting[request_id]
        return out

    def wait(self, timeout_s: float) -> None:
        """Nothing else to run: sleep until a compile ends (or the timeout), rather than spin."""
        if self._waiting:
            wait([w.future for w in self._waiting.values()], timeout_s, FIRST_COMPLETED)


def _result(request_id: str, future: Future):
    exc = future.exception()
    return future.result() if exc is None else request_error(request_id, exc)
