"""How this worker's requests went, each counted once. Prometheus's request counters
(`kvgate_request_success`, `kvgate_request_failures`, `kvgate_requests_poisoned`) and the registry
entry's `requests_*` fields are both read from here, so the two never disagree. The serving loop
counts; the heartbeat and the metrics server read from their own threads, hence the lock.
"""
from __future__ import annotations

import threading
from collections import Counter

REASONS = ("stop", "length", "abort")  # finish reasons whose series exist from the start
CODES = ("timeout", "engine_error", "request_failed", "context_length_exceeded", "invalid_request",
         "engine_step_failed", "resume_failed", "request_failed_repeatedly",
         "unsupported_schema")  # likewise, error codes
POISONED = "request_failed_repeatedly"  # the poison cap's code

# when a request was answered with an error (what the registry's fields tell apart)
ANSWERED = "answered"  # instead of running: unreadable, poison cap, unresumable, deadline, fault, crash
REJECTED = "rejected"  # at admission, the engine or the tokenizer refused its input
FAILED = "failed"  # after admission, while it ran


class Outcomes:
    def __init__(self):
        self._lock = threading.Lock()
        self._admitted = 0
        self._resumed = 0  # of the admitted: taken over from a worker that stopped
        self._unstarted = 0  # cancelled before any worker started them: acknowledged, never run
        # finish reason -> requests that ran to their end here ("abort": cancelled or timed out)
        self._ended: Counter[str] = Counter(dict.fromkeys(REASONS, 0))
        self._errors: Counter[tuple[str, str]] = Counter()  # (when, code)

    def admitted(self, resumed: bool) -> None:
        with self._lock:
            self._admitted += 1
            self._resumed += resumed

    def ended(self, reason: str) -> None:
        with self._lock:
            self._ended[reason] += 1

    def errored(self, code: str, when: str = ANSWERED) -> None:
        with self._lock:
            self._errors[when, code] += 1

    def cancelled_unstarted(self) -> None:
        with self._lock:
            self._unstarted += 1

    def by_reason(self) -> dict[str, int]:
        with self._lock:
            return dict(self._ended)

    def by_code(self) -> dict[str, int]:
        codes = dict.fromkeys(CODES, 0)
        with self._lock:
            for (_, code), n in self._errors.items():
                codes[code] = codes.get(code, 0) + n
        return codes

    def registry_fields(self) -> dict[str, int]:
        """The registry entry's counts (the gateway and the tests read them under these names)."""
        with self._lock:
            ended, errors = dict(self._ended), dict(self._errors)
            admitted, resumed, unstarted = self._admitted, self._resumed, self._unstarted
        by_when, by_code = Counter(), Counter()
        for (when, code), n in errors.items():
            by_when[when] += n
            by_code[code] += n
        return {"requests_admitted": admitted, "requests_finished": sum(ended.values()) - ended["abort"],
                "requests_aborted": ended["abort"] + unstarted, "requests_rejected": by_when[REJECTED],
                "requests_resumed": resumed, "requests_failed": by_when[FAILED],
                "requests_poisoned": by_code[POISONED]}
