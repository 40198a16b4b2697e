"""A program's state: its text so far and its variables. `s += x` queues x on the state's own thread
and returns at once, so the states of a fork run side by side (and their calls share a batch and the
prefix cache); reading a variable or the text waits for what was queued before. The first failing
step is kept and raised at the next read (or the program's end, or the fork's join); the steps
queued after it do not run."""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from kvgate.lang.backends import Backend, BackendError
from kvgate.lang.errors import ProgramError
from kvgate.lang.ops import Gen, Role, Select

_END = object()  # closes a variable's stream
# a shared prefix this long (a few hundred tokens, more than one CPU step's chunk) is computed once
# before a fork's branches go; a shorter one costs the branches less than the extra round trip
PREFILL_BEFORE_FORK_CHARS = 1024


class ProgramState:
    def __init__(self, backend: Backend, stream: bool = False, text: str = "", variables: dict | None = None,
                 chatting: bool = False):
        self.backend, self.stream = backend, stream
        self._text = text
        self.variables: dict = dict(variables or {})
        self.scores: dict[str, list[float]] = {}  # select name -> each choice's mean logprob
        self._chatting = chatting  # a role message was written: the next needs no `begin`
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._error: ProgramError | None = None
        self._streams: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()

    # --- what a program does
    def __iadd__(self, item) -> ProgramState:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvgate-lang-state")
        self._pending.append(self._executor.submit(self._run, item))
        return self

    def __getitem__(self, name: str):
        self.sync()
        return self.variables[name]

    def __setitem__(self, name: str, value) -> None:
        """A variable the program computes itself (after every queued step)."""
        self.sync()
        self.variables[name] = value

    def text(self) -> str:
        self.sync()
        return self._text

    def fork(self, n: int) -> ForkGroup:
        """n states that start from everything so far (the server sees one shared prefix, computed
        once before the branches go: `Backend.prefill`)."""
        self.sync()
        if n > 1 and len(self._text) >= PREFILL_BEFORE_FORK_CHARS:
            try:
                self.backend.prefill(self._text)
            except BackendError as exc:
                raise ProgramError(f"fork({n})", exc.message, exc.status, exc.code) from exc
        return ForkGroup(ProgramState(self.backend, self.stream, self._text, self.variables, self._chatting)
                         for _ in range(n))

    def text_iter(self, name: str):
        """The pieces of variable `name` as they are generated (a program run with stream=True)."""
        q = self._stream(name)
        while (piece := q.get()) is not _END:
            yield piece
        if self._error is not None:
            raise self._error

    # --- how it runs
    def sync(self) -> None:
        """Wait for every queued step; raise the first one's error."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()
        if self._error is not None:
            raise self._error

    @property
    def error(self) -> ProgramError | None:
        return self._error

    def fail(self, error: ProgramError) -> None:
        self._error = self._error or error

    def close(self) -> None:
        """After the program: its thread stops and every variable stream ends."""
        try:
            for future in self._pending:
                future.exception()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=False)
                self._executor = None
            with self._lock:
                for q in self._streams.values():
                    q.put(_END)

    def _stream(self, name: str) -> queue.Queue:
        with self._lock:
            return self._streams.setdefault(name, queue.Queue())

    def _run(self, item) -> None:
        if self._error is not None:
            return
        step = getattr(item, "step", "text")
        try:
            self._apply(item)
        except ProgramError as exc:
            self._error = exc
        except BackendError as exc:
            self._error = ProgramError(step, exc.message, exc.status, exc.code)
        except Exception as exc:  # a bug or a bad argument: still named by its step
            self._error = ProgramError(step, f"{type(exc).__name__}: {exc}")

    def _apply(self, item) -> None:
        if isinstance(item, str):
            self._text += item
        elif isinstance(item, Gen):
            self._gen(item)
        elif isinstance(item, Select):
            self._select(item)
        elif isinstance(item, Role):
            self._role(item)
        else:
            raise TypeError(f"cannot add a {type(item).__name__} to a program state")

    def _gen(self, g: Gen) -> None:
        on_text = None
        if self.stream:
            q = self._stream(g.name)
            on_text = q.put
        try:
            out = self.backend.generate(self._text, g.params(), on_text)
        finally:
            if on_text is not None:
                q.put(_END)
        self.variables[g.name] = out.text
        self._text += out.text

    def _select(self, sel: Select) -> None:
        scores = self.backend.score(self._text, sel.choices)
        best = max(range(len(scores)), key=lambda i: scores[i])  # the first of equals
        self.variables[sel.name], self.scores[sel.name] = sel.choices[best], scores
        self._text += sel.choices[best]

    def _role(self, msg: Role) -> None:
        markers = self.backend.markers()
        if markers is None:
            raise ProgramError(f"{msg.role}(...)", "the served model has no chat role markers (its chat "
                               "template is missing or not role-prefix/suffix shaped); write the chat as text")
        if not self._chatting:
            self._text += markers["system_begin"] if msg.role == "system" else markers["begin"]
            self._chatting = True
        generates = any(isinstance(p, (Gen, Select)) for p in msg.parts)
        self._text += markers["generation"] if msg.role == "assistant" and generates else markers["start"][msg.role]
        for part in msg.parts:  # a generation inside names itself
            try:
                self._apply(part)
            except BackendError as exc:
                raise ProgramError(getattr(part, "step", msg.step), exc.message, exc.status, exc.code) from exc
        self._text += markers["end"]


class ForkGroup(list):
    """The states of one fork. `forks += x` adds x to each; join() waits for all of them and raises
    the first branch's error, naming the branch."""

    def __iadd__(self, item) -> ForkGroup:
        for state in self:
            state += item
        return self

    def join(self) -> ForkGroup:
        first = None
        for i, state in enumerate(self):
            try:
                state.sync()
            except ProgramError as exc:
                first = first or exc.within(f"fork {i}")
            finally:
                state.close()
        if first is not None:
            raise first
        return self
