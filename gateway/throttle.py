"""Per-address throttles, in this process's memory: failed authentications (so a key cannot be
guessed at line rate) and the public routes (/healthz, /readyz, /metrics).

slowapi's Limiter with memory storage and a moving window: no Redis call, so nothing here blocks
the event loop, and each gateway process counts on its own (N processes allow N budgets). Its route
decorator counts every request, so failures are counted here, after the fact, through the
Limiter's own strategy. The address is the socket peer as uvicorn reports it; behind a proxy,
uvicorn's --forwarded-allow-ips decides whether X-Forwarded-For replaces it.
"""
from __future__ import annotations

import time

from fastapi import Request
from limits import RateLimitItem, RateLimitItemPerMinute
from slowapi import Limiter
from slowapi.util import get_remote_address

from shared.errors import RateLimited


class Throttle:
    def __init__(self, auth_failures_per_minute: int, public_per_minute: int):
        self.limiter = Limiter(key_func=get_remote_address, storage_uri="memory://",
                               strategy="moving-window", key_prefix="kvgate")
        self.failures = RateLimitItemPerMinute(auth_failures_per_minute)
        self.public = RateLimitItemPerMinute(public_per_minute)

    def check_auth(self, request: Request) -> None:
        """429 while the address is over its budget of failed authentications, before the key is
        looked at: otherwise a right guess would still stand out from the wrong ones."""
        address = get_remote_address(request)
        if not self.limiter.limiter.test(self.failures, "auth-failures", address):
            raise self._refusal(self.failures, "auth-failures", address,
                                "Too many failed authentications from this address",
                                "too_many_failed_auth")

    def auth_failed(self, request: Request) -> None:
        """Count a missing, unknown, revoked or expired key against the caller's address."""
        self.limiter.limiter.hit(self.failures, "auth-failures", get_remote_address(request))

    def public_route(self, request: Request) -> None:
        """A FastAPI dependency of the routes that need no key: generous, per address."""
        address = get_remote_address(request)
        if not self.limiter.limiter.hit(self.public, "public", address):
            raise self._refusal(self.public, "public", address,
                                "Too many requests to the public routes from this address",
                                "too_many_requests")

    def _refusal(self, item: RateLimitItem, scope: str, address: str, what: str,
                 code: str) -> RateLimited:
        stats = self.limiter.limiter.get_window_stats(item, scope, address)
        wait = max(1.0, stats.reset_time - time.time())
        return RateLimited(f"{what} (limit {item.amount} per minute); retry in {wait:.0f}s",
                           code=code, retry_after=wait)
