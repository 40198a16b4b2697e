"""How long one request may take: to its first token, and in total. The gateway's defaults
(KVGATE_TTFT_TIMEOUT_S, KVGATE_REQUEST_TIMEOUT_S), replaced per route kind by
KVGATE_ROUTE_TIMEOUTS, replaced per key by the key's own `ttft_timeout_s` / `request_timeout_s`.
The gateway enforces both on the replies it waits for (gateway/dispatch.py: a 504 and a cancel, so
the worker frees the request's KV); the total also travels in the entry as its deadline, which a
worker checks before starting it. Batch lines wait behind interactive traffic by design: only
their total applies.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.keys import KeyRecord
from shared import names
from shared.errors import RequestTimeout
from shared.settings import GatewaySettings, RouteKind

# the route kinds KVGATE_ROUTE_TIMEOUTS names, by path
ROUTES: dict[str, RouteKind] = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
                                "/v1/responses": "responses", "/v1/messages": "messages"}


@dataclass(frozen=True)
class Timeouts:
    ttft_s: float | None  # None: no limit before the first token but the total
    total_s: float
    ttft_by: str  # the setting each came from, named in the error
    total_by: str

    def first_token_by(self, start: float) -> float:
        return math.inf if self.ttft_s is None else start + self.ttft_s

    def no_first_token(self) -> RequestTimeout:
        return RequestTimeout(f"No token within the time-to-first-token limit of {self.ttft_s:g} s "
                              f"({self.ttft_by}); the request was cancelled", code="ttft_timeout")

    def total_passed(self) -> RequestTimeout:
        return RequestTimeout(f"The request exceeded its total time limit of {self.total_s:g} s "
                              f"({self.total_by}); it was cancelled")


def of(settings: GatewaySettings, key: KeyRecord, path: str, lane: str) -> Timeouts:
    """The limits of a request by `key` on `path` in `lane`: the key's, else its route's, else
    the gateway's; 0 (or a batch line) means no time-to-first-token limit."""
    route = ROUTES.get(path)
    override = settings.route_timeouts.get(route) if route else None
    ttft, ttft_by = settings.ttft_timeout_s, "KVGATE_TTFT_TIMEOUT_S"
    total, total_by = settings.request_timeout_s, "KVGATE_REQUEST_TIMEOUT_S"
    if override is not None and override.ttft_s is not None:
        ttft, ttft_by = override.ttft_s, f"KVGATE_ROUTE_TIMEOUTS[{route}]"
    if override is not None and override.total_s is not None:
        total, total_by = override.total_s, f"KVGATE_ROUTE_TIMEOUTS[{route}]"
    if key.ttft_timeout_s is not None:
        ttft, ttft_by = key.ttft_timeout_s, f"key '{key.name}' ttft_timeout_s"
    if key.request_timeout_s is not None:
        total, total_by = key.request_timeout_s, f"key '{key.name}' request_timeout_s"
    if not ttft or lane != names.DEFAULT_LANE:
        ttft = None
    return Timeouts(ttft, total, ttft_by, total_by)
