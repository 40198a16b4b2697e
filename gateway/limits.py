"""Per-key limits, all counted in Redis so every gateway replica shares them exactly.

- requests per minute: a moving window, a sorted set of the minute's requests by Redis's clock.
- requests in flight: a sorted set request id -> expiry; a member whose gateway died ages out at
  its expiry (the safety TTL).
- tokens per minute and per UTC day: a reservation (the estimate) checked against both and charged
  to both at admission; the actual usage replaces it when the request ends.
All of a request's admission is one Lua script on the key's `{k:}` slot (ADMIT): one round trip.
"""
from __future__ import annotations

import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import IntEnum

import redis.asyncio as aioredis

from gateway.keys import KeyRecord
from gateway.metrics import rate_limited
from shared import names
from shared.errors import RateLimited
from shared.settings import GatewaySettings
from shared.usage import COUNT_USAGE_FN, utc_day

WINDOW_S = 60
DAY_TTL_S = 2 * 86400


class Verdict(IntEnum):
    """What ADMIT answers first: admitted, or the limit the request hit."""

    ADMITTED = 1
    OVER_TPM = 2
    OVER_DAILY = 3
    OVER_RPM = 4
    SLOT_FULL = 5  # the key has its cap of requests in flight


# The key's whole admission in one round trip (every key in its `{k:}` slot): the token window
# read (the x-ratelimit-*-tokens headers), then, each only when asked, a request counted in the
# minute, a slot in flight taken, tokens reserved on the minute and the day. A refusal stops there:
# what came before it stands (a request refused for its slot or its tokens still counted in the
# minute, as it always did), nothing after it is taken.
# KEYS: rpm window (sorted set member -> time), in-flight set, tpm hash, daily counter.
# ARGV: rpm limit (-1: count no request), member, slot cap (-1: take none), gateway now, slot
# expiry, slot key TTL (only ever lengthened: requests of one key may have different time limits),
# estimate (-1: reserve nothing), tpm limit, daily limit (-1: none).
# Returns {a Verdict, bucket second, tokens used in the window (after this request's estimate),
# seconds until the token window frees (enough for the estimate, on OVER_TPM), requests in the
# minute (after this one), ms until its oldest leaves the minute}.
ADMIT = """
local t = redis.call('TIME')
local sec = tonumber(t[1])
local now = sec + tonumber(t[2]) / 1000000
local est, tpm, daily = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local fields = redis.call('HGETALL', KEYS[3])
local live, used, first = {}, 0, nil
for i = 1, #fields, 2 do
  local s, n = tonumber(fields[i]), tonumber(fields[i + 1])
  if s <= sec - %(window)d then redis.call('HDEL', KEYS[3], fields[i])
  else
    used = used + n; live[#live + 1] = {s, n}
    if not first or s < first then first = s end
  end
end
local token_wait = first and (first + %(window)d - sec) or 0
local rpm, count, rpm_wait = tonumber(ARGV[1]), 0, 0
if rpm >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - %(window)d)
  count = redis.call('ZCARD', KEYS[1])
  local over = count >= rpm
  if not over then
    redis.call('ZADD', KEYS[1], now, ARGV[2])
    redis.call('EXPIRE', KEYS[1], %(window)d)
    count = count + 1
  end
  local oldest = tonumber(redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2] or now)
  rpm_wait = math.floor((oldest + %(window)d - now) * 1000)
  if over then return {%(over_rpm)d, sec, used, token_wait, count, rpm_wait} end
end
local cap = tonumber(ARGV[3])
if cap >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[4])
  if redis.call('ZCARD', KEYS[2]) >= cap then return {%(slot_full)d, sec, used, token_wait, count, rpm_wait} end
end
if est >= 0 then
  if used + est > tpm then
    table.sort(live, function(a, b) return a[1] < b[1] end)
    local wait, left = %(window)d, used
    for _, b in ipairs(live) do
      left = left - b[2]
      if left + est <= tpm then wait = b[1] + %(window)d - sec; break end
    end
    return {%(over_tpm)d, sec, used, wait, count, rpm_wait}
  end
  local today = tonumber(redis.call('GET', KEYS[4]) or '0')
  if daily >= 0 and today + est > daily then return {%(over_daily)d, sec, used, %(window)d, count, rpm_wait} end
  redis.call('HINCRBY', KEYS[3], sec, est)
  redis.call('EXPIRE', KEYS[3], %(window)d * 2)
  redis.call('INCRBY', KEYS[4], est)
  redis.call('EXPIRE', KEYS[4], %(day_ttl)d)
  used, token_wait = used + est, %(window)d
end
if cap >= 0 then
  redis.call('ZADD', KEYS[2], ARGV[5], ARGV[2])
  if redis.call('TTL', KEYS[2]) < tonumber(ARGV[6]) then redis.call('EXPIRE', KEYS[2], ARGV[6]) end
end
return {%(admitted)d, sec, used, token_wait, count, rpm_wait}
""" % {"window": WINDOW_S, "day_ttl": DAY_TTL_S, "admitted": Verdict.ADMITTED,
       "over_tpm": Verdict.OVER_TPM, "over_daily": Verdict.OVER_DAILY, "over_rpm": Verdict.OVER_RPM,
       "slot_full": Verdict.SLOT_FULL}

# A reservation replaced by the actual count: `delta` more (or fewer) tokens in the minute's
# bucket it was charged to (or the current one, once that bucket left the window) and in its day.
SETTLE_TOKENS_FN = """
local function settle_tokens(tpm, day, bucket, delta)
  local now = tonumber(redis.call('TIME')[1])
  if bucket > now - %(window)d then redis.call('HINCRBY', tpm, bucket, delta)
  elseif delta > 0 then redis.call('HINCRBY', tpm, now, delta) end
  redis.call('EXPIRE', tpm, %(window)d * 2)
  redis.call('INCRBY', day, delta)
  redis.call('EXPIRE', day, %(day_ttl)d)
end
""" % {"window": WINDOW_S, "day_ttl": DAY_TTL_S}
# KEYS: the key's minute, its day. ARGV: bucket, delta.
SETTLE_TOKENS = SETTLE_TOKENS_FN + """
settle_tokens(KEYS[1], KEYS[2], tonumber(ARGV[1]), tonumber(ARGV[2]))
return 1
"""


# A request's whole settlement in one Redis (not a cluster): its tokens, its usage, its slot. KEYS
# from k+1: the key's minute, its day's tokens, the usage day index, the days to fold, the usage
# hash, the key's requests in flight. ARGV from a+1: bucket, delta ('': nothing to settle), key id,
# day, fold at, retention, usage field ('': no usage), prompt ('': an error), completion, slot ('':
# none). Offsets, so that a script can run it after its own (gateway/stream_leases.py CLAIM_SETTLE);
# the keys and arguments of a request's holdings: gateway/holdings.py settle_call.
SETTLE_FN = SETTLE_TOKENS_FN + COUNT_USAGE_FN + """
local function settle(k, a)
  if ARGV[a + 2] ~= '' then
    settle_tokens(KEYS[k + 1], KEYS[k + 2], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]))
  end
  if ARGV[a + 7] ~= '' then
    count_usage(KEYS[k + 3], KEYS[k + 4], KEYS[k + 5], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5],
                ARGV[a + 6], ARGV[a + 7], ARGV[a + 8], ARGV[a + 9])
  end
  if ARGV[a + 10] ~= '' then redis.call('ZREM', KEYS[k + 6], ARGV[a + 10]) end
end
"""
SETTLE = SETTLE_FN + """
settle(0, 0)
return 1
"""


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


@dataclass(frozen=True)
class Admission:
    """What the key's admission took: a slot in flight (False: none taken or the key has no cap),
    a token reservation (None: none asked), and the x-ratelimit-* headers it answers with."""

    slot: bool
    reservation: Reservation | None
    headers: dict[str, str]


@dataclass(frozen=True)
class AdmitCall:
    """One admission's script call: its keys and arguments, how to run it alone, and what reads its
    answer (an Admission, or the 429)."""

    keys: list
    args: list
    alone: Callable[[], Awaitable[list]]
    conclude: Callable[[list], Admission]


class FullMinutes:
    """The keys whose minute ADMIT last found full, each until its oldest request leaves the minute
    (in this process's memory). Until then no replica can count a request of that key, so a request
    of one is refused here with the same 429, before its body is read (gateway/auth.py AuthFirst):
    a key over its RPM sending MiB bodies otherwise had each parsed and validated (~30 ms of the
    event loop) for its 429. Kept with the limit it was full at: a key whose RPM changed is asked
    again; and with where its tokens stood then, so that 429 carries the token headers too."""

    BOUND = 65536  # keys remembered at most (a key is one entry: the keys in Redis bound it anyway)

    def __init__(self):
        # key id -> (monotonic end, its rpm then, (its TPM, tokens used, monotonic end of their window))
        self._until: dict[str, tuple[float, int, tuple[int, int, float]]] = {}

    def full(self, key_id: str, rpm: int, until: float, tokens: tuple[int, int, float] = (0, 0, 0.0)) -> None:
        if len(self._until) >= self.BOUND and key_id not in self._until:
            now = time.monotonic()
            self._until = {k: v for k, v in self._until.items() if v[0] > now}
            if len(self._until) >= self.BOUND:
                self._until.pop(next(iter(self._until)))
        self._until[key_id] = (until, rpm, tokens)

    def wait(self, key_id: str, rpm: int) -> float | None:
        """Seconds until the key's minute has room, while it is known full at this `rpm`."""
        if (entry := self._until.get(key_id)) is None:
            return None
        left = entry[0] - time.monotonic()
        if left <= 0 or entry[1] != rpm:
            del self._until[key_id]
            return None
        return left

    def tokens(self, key_id: str) -> tuple[int, int, float]:
        """(TPM, tokens used, monotonic end of their window) when the key's minute was found full."""
        return self._until[key_id][2]


class Limits:
    def __init__(self, redis: aioredis.Redis, settings: GatewaySettings):
        self.redis = redis
        self.settings = settings
        self.full_minutes = FullMinutes()
        self._admit = redis.register_script(ADMIT)
        self._settle = redis.register_script(SETTLE_TOKENS)
        self._settle_all = redis.register_script(SETTLE)

    def rpm(self, key: KeyRecord) -> int:
        return key.rpm or self.settings.default_rpm

    def tpm(self, key: KeyRecord) -> int:
        return key.tpm or self.settings.default_tpm

    async def admit(self, key: KeyRecord, count: bool = False, slot_id: str | None = None,
                    total_s: float | None = None, estimate: int | None = None) -> Admission:
        """The key's limits in one round trip: a request counted in its minute (`count`), a slot
        in flight taken (`slot_id`; `total_s` the request's time limit, default
        KVGATE_REQUEST_TIMEOUT_S), `estimate` tokens reserved on its minute and day; or 429
        naming the limit hit, with the headers. The token headers come back either way."""
        call = self.prepare(key, count, slot_id, total_s, estimate)
        return call.conclude(await call.alone())

    def prepare(self, key: KeyRecord, count: bool = False, slot_id: str | None = None,
                total_s: float | None = None, estimate: int | None = None) -> AdmitCall:
        """`admit` as a script call not yet made: run it alone (`alone`), or ahead of the XADD in
        the dispatcher's round trip (one Redis; gateway/dispatch.py), then `conclude` its answer."""
        now, total_s = time.time(), total_s or self.settings.request_timeout_s
        sent = time.monotonic()  # before the script runs: a wait counted from here ends no later
        cap = key.max_concurrent if slot_id is not None and key.max_concurrent is not None else -1
        member = slot_id or secrets.token_hex(8)
        tpm, rpm = self.tpm(key), self.rpm(key)
        keys = [names.rpm_key(key.id), names.inflight_key(key.id), names.tpm_key(key.id),
                names.daily_tokens_key(key.id, utc_day(now))]
        args = [rpm if count else -1, member, cap, now, now + total_s + 60, int(total_s) + 120,
                -1 if estimate is None else estimate, tpm,
                key.daily_tokens if key.daily_tokens is not None else -1]

        def conclude(answer: list) -> Admission:
            verdict, bucket, used, token_wait, requests, rpm_wait_ms = answer
            headers = self.token_headers(tpm, used, token_wait)
            if count:
                headers |= {"x-ratelimit-limit-requests": str(rpm),
                            "x-ratelimit-remaining-requests": str(max(0, rpm - requests)),
                            "x-ratelimit-reset-requests": duration(rpm_wait_ms / 1000)}
            if verdict == Verdict.OVER_RPM:
                self.full_minutes.full(key.id, rpm, sent + rpm_wait_ms / 1000, (tpm, used, sent + token_wait))
            if verdict != Verdict.ADMITTED:
                raise _refusal(Verdict(verdict), key, headers, now, rpm=rpm, tpm=tpm, used=used,
                               estimate=estimate, wait=rpm_wait_ms / 1000 if verdict == Verdict.OVER_RPM
                               else token_wait)
            reservation = (Reservation(key.id, int(bucket), utc_day(now), estimate)
                           if estimate is not None else None)
            return Admission(cap >= 0, reservation, headers)

        return AdmitCall(keys, args, lambda: self._admit(keys=keys, args=args), conclude)

    def known_full(self, key: KeyRecord) -> RateLimited | None:
        """The 429 a request of `key` would get for its minute, when ADMIT said so already and the
        minute has not moved on since (FullMinutes): asked before the body is read."""
        rpm = self.rpm(key)
        if (wait := self.full_minutes.wait(key.id, rpm)) is None:
            return None
        tpm, used, tokens_end = self.full_minutes.tokens(key.id)  # as they stood then: no round trip
        headers = self.token_headers(tpm, used, max(0.0, tokens_end - time.monotonic())) | {
            "x-ratelimit-limit-requests": str(rpm), "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-reset-requests": duration(wait)}
        return _refusal(Verdict.OVER_RPM, key, headers, time.time(), rpm=rpm, tpm=self.tpm(key),
                        used=0, estimate=None, wait=wait)

    # -- one limit at a time (files, tests): each is `admit` asked for one thing ----------------
    async def count_request(self, key: KeyRecord) -> dict[str, str]:
        """Admit one request into the key's minute or raise 429; the x-ratelimit-* headers."""
        return (await self.admit(key, count=True)).headers

    async def acquire_slot(self, key: KeyRecord, request_id: str, total_s: float | None = None) -> bool:
        """Take one of the key's in-flight slots, or raise 429. False when the key has no cap."""
        return (await self.admit(key, slot_id=request_id, total_s=total_s)).slot

    async def release_slot(self, key: KeyRecord, request_id: str) -> None:
        await self.redis.zrem(names.inflight_key(key.id), request_id)

    async def reserve_tokens(self, key: KeyRecord, estimate: int) -> tuple[Reservation, dict[str, str]]:
        """Charge `estimate` tokens to the key's minute and day, or raise 429 naming the limit."""
        admission = await self.admit(key, estimate=estimate)
        return admission.reservation, admission.headers

    async def settle_tokens(self, reservation: Reservation, actual: int) -> None:
        """Replace the reservation by what the request actually used (a refund when less)."""
        delta = actual - reservation.estimate
        if delta:
            await self._settle(keys=[names.tpm_key(reservation.key_id),
                                     names.daily_tokens_key(reservation.key_id, reservation.day)],
                               args=[reservation.bucket, delta])

    async def settle(self, keys: list[str], args: list) -> None:
        """A request's tokens, usage and slot given back in one script (SETTLE; its keys and
        arguments: gateway/holdings.py settle_call)."""
        await self._settle_all(keys=keys, args=args)

    async def token_window(self, key: KeyRecord) -> dict[str, str]:
        """The x-ratelimit-*-tokens headers from the key's last minute."""
        return (await self.admit(key)).headers

    @staticmethod
    def token_headers(limit: int, used: int, reset_s: float) -> dict[str, str]:
        return {"x-ratelimit-limit-tokens": str(limit),
                "x-ratelimit-remaining-tokens": str(max(0, limit - used)),
                "x-ratelimit-reset-tokens": duration(reset_s)}


def _refusal(verdict: Verdict, key: KeyRecord, headers: dict[str, str], now: float, *, rpm: int,
             tpm: int, used: int, estimate: int | None, wait: float) -> RateLimited:
    """The 429 of the limit a request hit, worded as OpenAI words it, with where the key stands."""
    if verdict == Verdict.OVER_RPM:
        rate_limited("rpm")
        return RateLimited(  # a 429 still tells the client where it stands: the headers
            f"Rate limit reached for key '{key.name}' on requests per minute (RPM): "
            f"Limit {rpm}, Used {rpm}, Requested 1. "
            f"Please try again in {duration(wait)}.", retry_after=wait, headers=headers)
    if verdict == Verdict.SLOT_FULL:
        rate_limited("concurrency")
        return RateLimited(f"Too many concurrent requests for key '{key.name}': "
                           f"Limit {key.max_concurrent} in flight. Retry when one finishes.",
                           retry_after=1, headers=headers)
    if verdict == Verdict.OVER_TPM:
        rate_limited("tpm")
        return RateLimited(
            f"Rate limit reached for key '{key.name}' on tokens per minute (TPM): "
            f"Limit {tpm}, Used {used}, Requested {estimate}. "
            f"Please try again in {duration(wait)}.", retry_after=wait, headers=headers)
    rate_limited("daily")
    return RateLimited(
        f"Daily token budget of key '{key.name}' exhausted: Limit {key.daily_tokens}, "
        f"Requested {estimate}. It resets at 00:00 UTC.",
        code="insufficient_quota", retry_after=seconds_to_midnight(now), headers=headers)
