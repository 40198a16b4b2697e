"""Per-key limits, all counted in Redis so every gateway replica shares them exactly.

- requests per minute: a moving window from the `limits` library (slowapi's engine), through its
  asyncio storage (`limits.aio`, redis-py's asyncio client), because slowapi's own path calls
  synchronous Redis from inside the event loop. The window's check-and-push is one Lua script.
- requests in flight: a sorted set request id -> expiry, checked and added in one Lua script; a
  member whose gateway died ages out at its expiry (the safety TTL).
- tokens per minute and per UTC day: a reservation (the estimate) checked against both and charged
  to both in one Lua script at admission; the actual usage replaces it when the request ends.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from enum import IntEnum

import redis.asyncio as aioredis
from limits import RateLimitItemPerMinute
from limits.aio.strategies import MovingWindowRateLimiter

from gateway.keys import KeyRecord
from gateway.metrics import rate_limited
from shared import names
from shared.errors import RateLimited
from shared.redis_client import rate_limit_storage
from shared.settings import GatewaySettings
from shared.usage import utc_day

WINDOW_S = 60
DAY_TTL_S = 2 * 86400


class Slot(IntEnum):
    """What ACQUIRE_SLOT answers."""

    FULL = 0  # the key has its cap of requests in flight
    TAKEN = 1


# KEYS: the key's in-flight set. ARGV: now, cap, expiry, slot id, key TTL (only ever lengthened:
# requests of one key may have different time limits).
ACQUIRE_SLOT = """
local now = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return %(full)d end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
if redis.call('TTL', KEYS[1]) < tonumber(ARGV[5]) then redis.call('EXPIRE', KEYS[1], ARGV[5]) end
return %(taken)d
""" % {"full": Slot.FULL, "taken": Slot.TAKEN}


class Reserved(IntEnum):
    """What RESERVE_TOKENS answers first: admitted, or the limit the request hit."""

    ADMITTED = 1
    OVER_TPM = 2
    OVER_DAILY = 3


# KEYS: tpm hash, daily counter. ARGV: estimate, tpm limit, daily limit (-1: none).
# Returns {a Reserved, bucket second, tokens used in the window after this request, seconds until
# enough of the window frees up (OVER_TPM only)}.
RESERVE_TOKENS = """
local now = tonumber(redis.call('TIME')[1])
local est, tpm, daily = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local fields = redis.call('HGETALL', KEYS[1])
local live, used = {}, 0
for i = 1, #fields, 2 do
  local sec, n = tonumber(fields[i]), tonumber(fields[i + 1])
  if sec <= now - %(window)d then redis.call('HDEL', KEYS[1], fields[i])
  else used = used + n; live[#live + 1] = {sec, n} end
end
if used + est > tpm then
  table.sort(live, function(a, b) return a[1] < b[1] end)
  local wait, left = %(window)d, used
  for _, b in ipairs(live) do
    left = left - b[2]
    if left + est <= tpm then wait = b[1] + %(window)d - now; break end
  end
  return {%(over_tpm)d, now, used, wait}
end
local today = tonumber(redis.call('GET', KEYS[2]) or '0')
if daily >= 0 and today + est > daily then return {%(over_daily)d, now, used, 0} end
redis.call('HINCRBY', KEYS[1], now, est)
redis.call('EXPIRE', KEYS[1], %(window)d * 2)
redis.call('INCRBY', KEYS[2], est)
redis.call('EXPIRE', KEYS[2], %(day_ttl)d)
return {%(admitted)d, now, used + est, 0}
""" % {"window": WINDOW_S, "day_ttl": DAY_TTL_S, "admitted": Reserved.ADMITTED,
       "over_tpm": Reserved.OVER_TPM, "over_daily": Reserved.OVER_DAILY}

# KEYS: tpm hash, daily counter. ARGV: admission bucket, actual - estimate.
SETTLE_TOKENS = """
local now = tonumber(redis.call('TIME')[1])
local bucket, delta = tonumber(ARGV[1]), tonumber(ARGV[2])
if bucket > now - %(window)d then redis.call('HINCRBY', KEYS[1], bucket, delta)
elseif delta > 0 then redis.call('HINCRBY', KEYS[1], now, delta) end
redis.call('EXPIRE', KEYS[1], %(window)d * 2)
redis.call('INCRBY', KEYS[2], delta)
redis.call('EXPIRE', KEYS[2], %(day_ttl)d)
return 1
""" % {"window": WINDOW_S, "day_ttl": DAY_TTL_S}


@dataclass
class Reservation:
    """Tokens charged at admission, to be replaced by the actual count when the request ends."""

    key_id: str
    bucket: int
    day: str
    estimate: int


def seconds_to_midnight(now: float) -> float:
    return 86400 - now % 86400


def duration(seconds: float) -> str:
    """OpenAI's reset format: '20ms', '17s', '6m0s'."""
    if seconds < 1:
        return f"{max(0, int(seconds * 1000))}ms"
    s = math.ceil(seconds)
    return f"{s // 60}m{s % 60}s" if s >= 60 else f"{s}s"


class Limits:
    def __init__(self, redis: aioredis.Redis, settings: GatewaySettings):
        self.redis = redis
        self.settings = settings
        self.rpm_window = MovingWindowRateLimiter(rate_limit_storage(redis, names.RPM_PREFIX))
        self._acquire_slot = redis.register_script(ACQUIRE_SLOT)
        self._reserve = redis.register_script(RESERVE_TOKENS)
        self._settle = redis.register_script(SETTLE_TOKENS)

    def rpm(self, key: KeyRecord) -> int:
        return key.rpm or self.settings.default_rpm

    def tpm(self, key: KeyRecord) -> int:
        return key.tpm or self.settings.default_tpm

    # -- requests per minute ---------------------------------------------------------------
    async def count_request(self, key: KeyRecord) -> dict[str, str]:
        """Admit one request into the key's minute or raise 429; the x-ratelimit-*-requests headers."""
        item = RateLimitItemPerMinute(self.rpm(key))
        admitted = await self.rpm_window.hit(item, key.id)
        stats = await self.rpm_window.get_window_stats(item, key.id)
        wait = max(0.0, stats.reset_time - time.time())
        headers = {"x-ratelimit-limit-requests": str(item.amount),
                   "x-ratelimit-remaining-requests": str(stats.remaining),
                   "x-ratelimit-reset-requests": duration(wait)}
        if not admitted:
            rate_limited("rpm")
            raise RateLimited(  # a 429 still tells the client where it stands: the headers
                f"Rate limit reached for key '{key.name}' on requests per minute (RPM): "
                f"Limit {item.amount}, Used {item.amount}, Requested 1. "
                f"Please try again in {duration(wait)}.", retry_after=wait, headers=headers)
        return headers

    # -- requests in flight ----------------------------------------------------------------
    async def acquire_slot(self, key: KeyRecord, request_id: str, total_s: float | None = None) -> bool:
        """Take one of the key's in-flight slots, or raise 429. False when the key has no cap.
        `total_s`: the request's time limit (default KVGATE_REQUEST_TIMEOUT_S)."""
        if key.max_concurrent is None:
            return False
        now, total_s = time.time(), total_s or self.settings.request_timeout_s
        expires = now + total_s + 60  # outlives the request
        slot = await self._acquire_slot(keys=[names.inflight_key(key.id)],
                                      args=[now, key.max_concurrent, expires, request_id,
                                            int(total_s) + 120])
        if slot == Slot.FULL:
            rate_limited("concurrency")
            raise RateLimited(f"Too many concurrent requests for key '{key.name}': "
                              f"Limit {key.max_concurrent} in flight. Retry when one finishes.",
                              retry_after=1)
        return True

    async def release_slot(self, key: KeyRecord, request_id: str) -> None:
        await self.redis.zrem(names.inflight_key(key.id), request_id)

    # -- tokens per minute and per day -----------------------------------------------------
    async def reserve_tokens(self, key: KeyRecord, estimate: int) -> tuple[Reservation, dict[str, str]]:
        """Charge `estimate` tokens to the key's minute and day, or raise 429 naming the limit."""
        now = time.time()
        day = utc_day(now)
        tpm = self.tpm(key)
        outcome, bucket, used, wait = await self._reserve(
            keys=[names.tpm_key(key.id), names.daily_tokens_key(key.id, day)],
            args=[estimate, tpm, key.daily_tokens if key.daily_tokens is not None else -1])
        headers = self.token_headers(tpm, used, wait if outcome == Reserved.OVER_TPM else WINDOW_S)
        if outcome == Reserved.OVER_TPM:
            rate_limited("tpm")
            raise RateLimited(
                f"Rate limit reached for key '{key.name}' on tokens per minute (TPM): "
                f"Limit {tpm}, Used {used}, Requested {estimate}. "
                f"Please try again in {duration(wait)}.", retry_after=wait, headers=headers)
        if outcome == Reserved.OVER_DAILY:
            rate_limited("daily")
            raise RateLimited(
                f"Daily token budget of key '{key.name}' exhausted: Limit {key.daily_tokens}, "
                f"Requested {estimate}. It resets at 00:00 UTC.",
                code="insufficient_quota", retry_after=seconds_to_midnight(now), headers=headers)
        return Reservation(key.id, int(bucket), day, estimate), headers

    async def settle_tokens(self, reservation: Reservation, actual: int) -> None:
        """Replace the reservation by what the request actually used (a refund when less)."""
        delta = actual - reservation.estimate
        if delta:
            await self._settle(keys=[names.tpm_key(reservation.key_id),
                                     names.daily_tokens_key(reservation.key_id, reservation.day)],
                               args=[reservation.bucket, delta])

    async def token_window(self, key: KeyRecord) -> dict[str, str]:
        """The x-ratelimit-*-tokens headers from the key's last minute (read only)."""
        now = time.time()
        fields = await self.redis.hgetall(names.tpm_key(key.id))
        live = {int(s): int(n) for s, n in fields.items() if int(s) > now - WINDOW_S}
        wait = min(live) + WINDOW_S - now if live else 0.0
        return self.token_headers(self.tpm(key), sum(live.values()), wait)

    @staticmethod
    def token_headers(limit: int, used: int, reset_s: float) -> dict[str, str]:
        return {"x-ratelimit-limit-tokens": str(limit),
                "x-ratelimit-remaining-tokens": str(max(0, limit - used)),
                "x-ratelimit-reset-tokens": duration(reset_s)}
