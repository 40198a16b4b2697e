"""`@function` turns `def f(s, ...)` into a program: `f.run(**args)` runs it on a backend and returns
its state; `f.run_batch([...], max_concurrency)` runs many. The backend is the one given, else the
one `set_default_backend` set (SGLang's shape)."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from kvgate.lang.backends import Backend
from kvgate.lang.errors import ProgramError
from kvgate.lang.state import ProgramState

_default: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    global _default
    _default = backend


def _backend(given: Backend | None) -> Backend:
    backend = given or _default
    if backend is None:
        raise ValueError("no backend: pass backend=... or call set_default_backend(...)")
    return backend


class Program:
    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "program")
        self.__doc__ = fn.__doc__

    def run(self, *args, backend: Backend | None = None, stream: bool = False, **kwargs) -> ProgramState:
        """The state once the program ended (stream=False; its first failure raised), or at once
        (stream=True: read variables as they come with `state.text_iter(name)`)."""
        state = ProgramState(_backend(backend), stream=stream)
        if not stream:
            self._body(state, args, kwargs)
            if state.error is not None:
                raise state.error
            return state
        threading.Thread(target=self._body, args=(state, args, kwargs), daemon=True,
                         name=f"kvgate-lang-{self.__name__}").start()
        return state

    def run_batch(self, batch: list[dict], backend: Backend | None = None,
                  max_concurrency: int = 8) -> list[ProgramState]:
        """One state per argument dict, in order, at most `max_concurrency` programs at once. A program
        that failed does not stop the others: its state's `error` says why, and reading it raises."""
        backend = _backend(backend)

        def one(kwargs: dict) -> ProgramState:
            state = ProgramState(backend)
            self._body(state, (), kwargs)
            return state
        with ThreadPoolExecutor(max(1, max_concurrency), thread_name_prefix="kvgate-lang-batch") as pool:
            return list(pool.map(one, batch))

    def _body(self, state: ProgramState, args, kwargs) -> None:
        """The function, then every step it queued; any failure is kept on the state."""
        try:
            self.fn(state, *args, **kwargs)
            state.sync()
        except ProgramError as exc:
            state.fail(exc)
        except Exception as exc:
            state.fail(ProgramError(f"program {self.__name__}", f"{type(exc).__name__}: {exc}"))
        finally:
            state.close()


def function(fn) -> Program:
    """`@function` over `def f(s, ...)`: s is the program's state."""
    return Program(fn)
