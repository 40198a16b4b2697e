"""The gateway's constraint checker, as its own process (`python -m gateway.checker_process`): it
imports xgrammar and jsonschema once, then hands each request's checks to a forked child, so a
check runs off the gateway's event loop and its GIL, at a lower CPU priority, within a memory
limit, and is killed at its time bound (a thread cannot be stopped).

Lines in (stdin), one per request: [id, timeout_s, memory_mb, [[kind, text], ...]].
Lines out (stdout): ["ready"] once, then per request [id, "done", results] where results holds, in
order, null for each check that passed and [code, detail] for the first that did not (the last);
[id, "timeout", passed] or [id, "crash", passed] when its child was killed or died.

A child is forked ahead, while no check runs, and waits for its request, so a request pays neither
the fork (~3.5 ms for a process holding torch) nor, since the child says when it is done, its exit."""
from __future__ import annotations

import gc
import math
import os
import resource
import selectors
import signal
import sys
import time
from dataclasses import dataclass, field

import orjson

NICENESS = 10  # the gateway's own work comes first on a busy CPU
END = b'"end"\n'  # a child's last line: its results are all written


@dataclass
class _Child:
    pid: int
    job: int  # the write end the request goes down; closed once sent
    pipe: int  # the read end its results come up
    request_id: int = -1
    deadline: float = math.inf
    answered: bool = False  # said done; kept until its exit is seen, to be reaped
    output: bytearray = field(default_factory=bytearray)

    def results(self) -> list:
        lines = [orjson.loads(line) for line in bytes(self.output).split(b"\n") if line]
        return [r for r in lines if r != "end"]


def _fork() -> _Child:
    job_read, job_write = os.pipe()
    result_read, result_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(job_write)
            os.close(result_read)
            _child(job_read, result_write)
            code = 0
        finally:
            os._exit(code)
    os.close(job_read)
    os.close(result_write)
    return _Child(pid, job_write, result_read)


def _child(job: int, pipe: int) -> None:
    """In the forked child: wait for the request, then write each check's result as it finishes
    (so a kill still tells which one was running), then END."""
    from gateway import structured

    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)  # the requests and answers are the parent's alone
    os.dup2(devnull, 1)
    os.nice(NICENESS)
    chunks = []
    while chunk := os.read(job, 1 << 20):
        chunks.append(chunk)
    if not chunks:  # the checker ended before using this one
        return
    timeout_s, memory_mb, items = orjson.loads(b"".join(chunks))
    cpu_s = math.ceil(timeout_s) + 1  # should the checker die first, the kernel ends a runaway
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    _limit_memory(memory_mb)
    too_big = ("invalid_structured_output", f" needs more than {memory_mb} MB to compile; simplify it")
    for kind, text in items:
        try:
            problem = structured.problem(kind, text)
        except MemoryError:
            problem = too_big
        if problem is not None and "std::bad_alloc" in problem[1]:  # xgrammar's own MemoryError
            problem = too_big
        os.write(pipe, orjson.dumps(problem) + b"\n")
        if problem is not None:
            break
    os.write(pipe, END)


def _limit_memory(memory_mb: int) -> None:
    """The child's address space: what it inherited plus `memory_mb` (where /proc tells the first)."""
    try:
        with open("/proc/self/statm") as f:
            inherited = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return
    limit = inherited + (memory_mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


class Checker:
    def __init__(self):
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, _Child] = {}  # running or not yet reaped, by result pipe
        self.spare: _Child | None = _fork()
        self.inbox = bytearray()
        self.running = True

    def serve(self) -> None:
        os.set_blocking(0, False)
        self.selector.register(0, selectors.EVENT_READ)
        _answer(["ready"])
        while self.running or self.children:
            for key, _ in self.selector.select(self._wait()):
                if key.fd == 0:
                    self._read_requests()
                else:
                    self._read_child(self.children[key.fd])
            self._kill_late()
            if self.spare is None and self.running and all(c.answered for c in self.children.values()):
                self.spare = _fork()  # now, when it delays no running check's answer

    def _wait(self) -> float | None:
        deadline = min((c.deadline for c in self.children.values()), default=math.inf)
        return None if deadline == math.inf else max(0.0, deadline - time.monotonic())

    def _read_requests(self) -> None:
        chunk = os.read(0, 1 << 20)
        if not chunk:  # the gateway is gone: so is every check it asked for
            self.running = False
            self.selector.unregister(0)
            if self.spare is not None:
                os.close(self.spare.job)
            for child in [c for c in self.children.values() if not c.answered]:
                self._kill(child, "crash")
            return
        self.inbox += chunk
        *lines, rest = self.inbox.split(b"\n")
        self.inbox = bytearray(rest)
        for line in lines:
            self._start(*orjson.loads(line))

    def _start(self, request_id: int, timeout_s: float, memory_mb: int, items: list) -> None:
        child, self.spare = self.spare or _fork(), None
        child.request_id, child.deadline = request_id, time.monotonic() + timeout_s
        self.children[child.pipe] = child
        self.selector.register(child.pipe, selectors.EVENT_READ)
        job = memoryview(orjson.dumps([timeout_s, memory_mb, items]))
        try:
            while job:
                job = job[os.write(child.job, job):]
        except BrokenPipeError:  # it died waiting: its exit is read as a crash
            pass
        os.close(child.job)

    def _read_child(self, child: _Child) -> None:
        chunk = os.read(child.pipe, 1 << 16)
        if chunk:
            child.output += chunk
            if child.output.endswith(END) and not child.answered:
                self._report(child, "done")
            return
        _, status = os.waitpid(child.pid, 0)
        if not child.answered:
            self._report(child, "done" if os.waitstatus_to_exitcode(status) == 0 else "crash")
        self.selector.unregister(child.pipe)
        os.close(child.pipe)
        del self.children[child.pipe]

    def _kill_late(self) -> None:
        now = time.monotonic()
        for child in [c for c in self.children.values() if c.deadline <= now]:
            self._kill(child, "timeout")

    def _kill(self, child: _Child, how: str) -> None:
        """Its answer now; its exit is read (and it is reaped) as any other's."""
        os.kill(child.pid, signal.SIGKILL)
        self._report(child, how)

    def _report(self, child: _Child, how: str) -> None:
        child.answered, child.deadline = True, math.inf
        results = child.results()
        if how == "done" or (results and results[-1] is not None):  # a failure found is the answer
            _answer([child.request_id, "done", results])
        else:
            _answer([child.request_id, how, len(results)])


def _answer(message: list) -> None:
    os.write(1, orjson.dumps(message) + b"\n")


def main() -> None:
    import xgrammar  # noqa: F401  (imported once, here: every child shares it)

    from gateway import structured

    structured.problem("json", "{}")  # jsonschema's meta-schema validators, built once for all
    gc.freeze()  # what is here now is never scanned again: a child's collection copies no pages
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the gateway ends it through stdin
    Checker().serve()


if __name__ == "__main__":
    sys.exit(main())
