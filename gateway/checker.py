"""Checking a request's schemas, regexes and grammars before it is queued, off the gateway's event
loop. The checks are slow on hostile input (jsonschema's meta-check is Python: 0.3 s for a 25 KB
schema of empty properties, so 10 s for a body of such tools; xgrammar's front end takes seconds for
a schema full of `pattern`s) and cannot be stopped in a thread, so they run in a process of their
own (gateway/checker_process.py), a forked child per request, killed at `grammar_check_timeout_s`.

Tenants (API keys) take turns: one check of a key's runs at a time, `processes` in all, so a key
sending costly schemas waits behind its own, and another key's check waits for at most one of
each other key's. A result is kept (by digest), so a schema sent again is answered at once."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import sys
from collections import Counter, OrderedDict

import orjson

import gateway
from gateway.structured import Check
from shared.errors import InvalidStructuredOutput, Overloaded

log = logging.getLogger(__name__)

CACHED = 4096  # results kept, 16-byte digests: agents send the same schemas again and again
START_S = 120.0  # the checker imports xgrammar (and torch) once; a loaded machine takes a while
GRACE_S = 5.0  # past its time bound, a check the checker never answered means the checker is stuck


class Checker:
    def __init__(self, timeout_s: float, processes: int, memory_mb: int):
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self._slots = asyncio.Semaphore(processes)
        self._turns: dict[str, asyncio.Lock] = {}
        self._waiting: Counter[str] = Counter()
        self._results: OrderedDict[bytes, tuple[str, str] | None] = OrderedDict()
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task | None = None
        self._starting = asyncio.Lock()

    async def check(self, checks: list[Check], tenant: str) -> None:
        """400 naming the first check that fails (or runs past the time bound)."""
        todo: list[tuple[Check, bytes]] = []  # with its digest, computed once (a text is up to 1 MiB)
        for check in checks:
            digest = _digest(check)
            if digest not in self._results:
                todo.append((check, digest))
            else:
                self._results.move_to_end(digest)
                if (found := self._results[digest]) is not None:
                    raise check.refusal(*found)
        if todo:
            async with self._turn(tenant):
                await self._run(todo)

    async def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.stdin.close()  # the checker kills its children and ends
        try:
            await asyncio.wait_for(process.wait(), 5)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()
        if self._reader is not None:
            await self._reader

    @contextlib.asynccontextmanager
    async def _turn(self, tenant: str):
        self._waiting[tenant] += 1
        lock = self._turns.setdefault(tenant, asyncio.Lock())
        try:
            async with lock, self._slots:
                yield
        finally:
            self._waiting[tenant] -= 1
            if not self._waiting[tenant]:
                del self._waiting[tenant], self._turns[tenant]

    async def _run(self, todo: list[tuple[Check, bytes]]) -> None:
        process = await self._started()
        request_id = next(self._ids)
        answer = self._pending[request_id] = asyncio.get_running_loop().create_future()
        items = [[c.kind, c.text] for c, _ in todo]
        try:
            process.stdin.write(orjson.dumps([request_id, self.timeout_s, self.memory_mb, items]) + b"\n")
            await process.stdin.drain()
            how, results = await asyncio.wait_for(answer, self.timeout_s + GRACE_S)
        except asyncio.TimeoutError:
            log.error("the constraint checker did not answer within %.0f s; restarting it",
                      self.timeout_s + GRACE_S)
            self._process = None
            process.kill()
            raise Overloaded("The constraint checker was restarted; retry") from None
        except (BrokenPipeError, ConnectionResetError):
            raise Overloaded("The constraint checker stopped; retry") from None
        finally:
            self._pending.pop(request_id, None)
        self._conclude(todo, how, results)

    def _conclude(self, todo: list[tuple[Check, bytes]], how: str, results) -> None:
        if how != "done":  # killed at its time bound, or died: on the check it had not finished
            for _, digest in todo[:results]:
                self._keep(digest, None)
            running = todo[min(results, len(todo) - 1)][0]
            if how == "timeout":
                raise running.late(self.timeout_s)
            raise InvalidStructuredOutput(f"{running.param} could not be checked (the checker failed "
                                          f"on it); simplify it", param=running.param)
        for (_, digest), found in zip(todo, results):
            self._keep(digest, None if found is None else tuple(found))
        if results and results[-1] is not None:
            raise todo[len(results) - 1][0].refusal(*results[-1])

    def _keep(self, digest: bytes, found: tuple[str, str] | None) -> None:
        self._results[digest] = found
        while len(self._results) > CACHED:
            self._results.popitem(last=False)

    async def _started(self) -> asyncio.subprocess.Process:
        async with self._starting:
            if self._process is None or self._process.returncode is not None:
                self._process = await self._spawn()
                self._reader = asyncio.create_task(self._read(self._process))
            return self._process

    async def _spawn(self) -> asyncio.subprocess.Process:
        here = os.path.dirname(os.path.dirname(os.path.abspath(gateway.__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (here, os.environ.get("PYTHONPATH")) if p)}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.checker_process", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, env=env, limit=1 << 20)
        try:
            ready = await asyncio.wait_for(process.stdout.readline(), START_S)
        except asyncio.TimeoutError:
            ready = b""
        if orjson.loads(ready or b"null") != ["ready"]:
            process.kill()
            await process.wait()
            raise Overloaded("The constraint checker did not start; retry")
        return process

    async def _read(self, process: asyncio.subprocess.Process) -> None:
        """Answers by request id, until the checker ends: then every pending check fails (503)."""
        while line := await process.stdout.readline():
            request_id, how, results = orjson.loads(line)
            if (answer := self._pending.get(request_id)) is not None and not answer.done():
                answer.set_result((how, results))
        await process.wait()
        if self._process is process:
            self._process = None
        for answer in self._pending.values():
            if not answer.done():
                answer.set_exception(Overloaded("The constraint checker stopped; retry"))


def _digest(check: Check) -> bytes:
    return hashlib.blake2b(f"{check.kind}\0{check.text}".encode(), digest_size=16).digest()

