"""A whole (non-streamed) answer's replies, held back and sent together.

A client that asked for `stream: false` sees nothing until its request is done, so the worker need
not publish (and log) a reply per token for it. The admission verdict and the first token — which
end the gateway's wait for a first token, its retry window and the queue gate's hold — wait at
most KVGATE_FIRST_HOLD_S (20 ms; or KVGATE_HOLD_S, if shorter), so an answer done by then goes out
in one flush:
verdict, merged tokens, done. After the first token, each choice's deltas are merged here and sent
when the choice finishes, when the request fails, or every KVGATE_HOLD_S (1 s; 0 sends each as it
comes). A 16-token answer of a fast engine costs its gateway one message instead of 17, and the
worker one round trip instead of two (worker/service.py).

Nothing held was published or logged, so a worker that dies holding deltas is a worker that died
before those steps: the one that resumes the request recomputes them from the log, as it would.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared import protocol

@dataclass
class _Choice:
    """One choice's deltas since the last send, in order."""

    texts: list[str] = field(default_factory=list)
    reasonings: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict | None] | None = None
    finish_reason: str | None = None

    def add(self, text: str, reasoning: str | None, token_ids: list[int], logprobs: list[dict] | None,
            prompt_logprobs: list[dict | None] | None, finish_reason: str | None) -> None:
        self.texts.append(text)
        if reasoning:
            self.reasonings.append(reasoning)
        self.token_ids += token_ids
        if logprobs is not None:
            self.logprobs = (self.logprobs or []) + logprobs
        if self.prompt_logprobs is None:
            self.prompt_logprobs = prompt_logprobs
        self.finish_reason = finish_reason or self.finish_reason

    def delta(self, request_id: str, seq: int, index: int) -> protocol.Delta:
        return protocol.Delta(request_id=request_id, seq=seq, index=index, text="".join(self.texts),
                              reasoning="".join(self.reasonings) or None, token_ids=self.token_ids,
                              logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs,
                              finish_reason=self.finish_reason)


@dataclass
class Held:
    """One request's held deltas, per choice, and since when the oldest has waited."""

    since: float = field(default_factory=time.monotonic)
    choices: dict[int, _Choice] = field(default_factory=dict)
    verdict: bool = False  # the admission verdict waits too, to go out first with the first token

    def choice(self, index: int) -> _Choice:
        """Where choice `index`'s next delta goes (no Delta is built for a held one)."""
        return self.choices.setdefault(index, _Choice())

    def take(self, index: int | None = None) -> list[tuple[int, _Choice]]:
        """The held choices (one, or all in index order), removed from here."""
        picked = sorted(self.choices) if index is None else [index] if index in self.choices else []
        return [(i, self.choices.pop(i)) for i in picked]

    def due(self, now: float, hold_s: float) -> bool:
        """The oldest delta waited `hold_s`: a long answer's log stays at most this far behind."""
        return now - self.since >= hold_s
