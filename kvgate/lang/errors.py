"""The one exception a program raises: which step failed (`gen 'answer'`, `select 'pick'`, `fork 2`),
and the server's own message, status and code when the server refused."""
from __future__ import annotations


class ProgramError(RuntimeError):
    def __init__(self, step: str, message: str, status: int | None = None, code: str | None = None):
        super().__init__(f"{step}: {message}")
        self.step, self.message, self.status, self.code = step, message, status, code

    def within(self, outer: str) -> ProgramError:
        """The same error seen from an enclosing step (a fork's join)."""
        return ProgramError(f"{outer}: {self.step}", self.message, self.status, self.code)
