"""Circuit breaker per model version, shared by every gateway through Redis.

closed → open after KVGATE_BREAKER_FAILURES failures (5xx answers, timeouts, also those a retry
absorbed; not a request that failed alone while the engine served the rest, `request_failed`) of a
version within KVGATE_BREAKER_WINDOW_S; open → its requests go to the route's stable
version when it is a canary's, else get a fast 503 naming it; after KVGATE_BREAKER_OPEN_S the first
request to arrive at any gateway becomes the one probe (half-open; the script grants it once): its
first token closes the breaker, its failure opens it for another OPEN_S. A probe that says nothing
within OPEN_S (its client left, its gateway died) lets the next request probe.

Every step is one Lua script on the version's two keys (`{m:<model>}`: one slot) and uses Redis's
clock, so gateways with skewed clocks agree. Nothing exists while a version is healthy; the state
hash and the failure window carry TTLs.
"""
from __future__ import annotations

import logging
import math
import secrets
from dataclasses import dataclass

import redis.asyncio as aioredis
from prometheus_client import Counter

from shared import names
from shared.errors import KvgateError, Overloaded, RequestFailed

log = logging.getLogger("kvgate.gateway")
CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_VALUE = {CLOSED: 0, OPEN: 1, HALF_OPEN: 2}  # the state gauge's values
STATE_TTL_MS = 86_400_000  # an open breaker nobody probes for a day closes by itself
TRANSITIONS = Counter("kvgate_gateway_breaker_transitions", "Circuit breaker transitions this "
                      "gateway made, by model, version and the state entered",
                      ["model", "version", "to"])

_NOW = "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"
# KEYS: state hash. ARGV: probe hold ms, probe token. → {verdict, ms to wait, state entered or ''}
ADMIT = _NOW + """
local s = redis.call('HMGET', KEYS[1], 'state', 'until', 'probe_until')
if not s[1] then return {'go', 0, ''} end
local entered = ''
if s[1] == 'open' then
  if now < tonumber(s[2]) then return {'refused', tonumber(s[2]) - now, ''} end
  entered = 'half_open'
elseif now < tonumber(s[3]) then
  return {'refused', tonumber(s[3]) - now, ''}
end
redis.call('HSET', KEYS[1], 'state', 'half_open', 'probe', ARGV[2], 'probe_until', now + ARGV[1])
return {'probe', 0, entered}
"""
# KEYS: state hash, failure window. ARGV: failures to open, window ms, open ms, probe token or '',
# a unique member, state TTL ms. → the state entered, or ''
FAILED = _NOW + """
local s = redis.call('HMGET', KEYS[1], 'state', 'probe')
if s[1] == 'open' then return '' end
if s[1] == 'half_open' then
  if ARGV[4] == '' or s[2] ~= ARGV[4] then return '' end
else
  redis.call('ZADD', KEYS[2], now, ARGV[5])
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[2]))
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  if redis.call('ZCARD', KEYS[2]) < tonumber(ARGV[1]) then return '' end
end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('HSET', KEYS[1], 'state', 'open', 'until', now + ARGV[3], 'opened', now)
redis.call('PEXPIRE', KEYS[1], ARGV[6])
return 'open'
"""
# KEYS: state hash, failure window. ARGV: probe token. → 'closed' if this probe closed it, else ''
SUCCEEDED = """
local s = redis.call('HMGET', KEYS[1], 'state', 'probe')
if s[1] ~= 'half_open' or s[2] ~= ARGV[1] then return '' end
redis.call('DEL', KEYS[1], KEYS[2])
return 'closed'
"""


# ADMIT as a part of a bigger script of the version's `{m:}` slot (gateway/dispatch.py's bounded
# XADD): reads the state hash `gate_key` and sets the host's locals `verdict` ('go', 'probe' or
# 'refused'), `gate_wait` (ms), `entered` and `gate_now`; writes nothing (`GATE_GRANT` does, once
# the rest may go on). Its decisions are ADMIT's, line for line.
GATE = """
do
  local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000)
  local s = redis.call('HMGET', gate_key, 'state', 'until', 'probe_until')
  if s[1] == 'open' and now < tonumber(s[2]) then verdict, gate_wait = 'refused', tonumber(s[2]) - now
  elseif s[1] == 'open' then verdict, entered = 'probe', 'half_open'
  elseif s[1] and now < tonumber(s[3]) then verdict, gate_wait = 'refused', tonumber(s[3]) - now
  elseif s[1] then verdict = 'probe' end
  gate_now = now
end
"""
# ARGV of its script: probe hold ms (gate_hold), probe token (gate_token)
GATE_GRANT = """
if verdict == 'probe' then
  redis.call('HSET', gate_key, 'state', 'half_open', 'probe', gate_token, 'probe_until', gate_now + gate_hold)
end
"""


class Refused(Exception):
    """The version's breaker refused a request at its XADD (nothing was queued): the router says
    where it goes instead (`Router.past_breaker`), or the refusal stands."""

    def __init__(self, wait_s: float):
        super().__init__(f"circuit open for {wait_s:g} s")
        self.wait_s = wait_s


@dataclass(frozen=True)
class Pass:
    """Whether a request may go to a version now, and if it is that version's probe, its token."""

    allowed: bool
    probe: str | None = None
    wait_s: float = 0.0


class Breaker:
    def __init__(self, redis: aioredis.Redis, failures: int, window_s: float, open_s: float):
        self.redis, self.failures = redis, failures
        self.window_ms, self.open_ms = int(window_s * 1000), int(open_s * 1000)
        self._admit = redis.register_script(ADMIT)
        self._failed = redis.register_script(FAILED)
        self._succeeded = redis.register_script(SUCCEEDED)

    @property
    def enabled(self) -> bool:
        return self.failures > 0

    async def admit(self, model: str, version: str) -> Pass:
        if not self.enabled:
            return Pass(True)
        token = secrets.token_hex(8)
        verdict, wait_ms, entered = await self._admit(keys=[names.breaker_state(model, version)],
                                                      args=[self.open_ms, token])
        self.moved(model, version, entered)
        if verdict == b"refused":
            return Pass(False, wait_s=int(wait_ms) / 1000)
        return Pass(True, token if verdict == b"probe" else None)

    def refusal(self, model: str, version: str, verdict: Pass) -> Overloaded:
        wait = max(1, math.ceil(verdict.wait_s))
        return Overloaded(f"model '{model}' version '{version}' is failing: its circuit breaker "
                           f"is open (KVGATE_BREAKER_FAILURES = {self.failures} failures within "
                           f"{self.window_ms / 1000:g} s); retry in {wait} s", param="model",
                           code="circuit_open", retry_after=wait)

    async def failed(self, model: str, version: str, probe: str | None) -> None:
        """One failure of this version (a probe's: it opens the breaker again)."""
        if not self.enabled:
            return
        entered = await self._failed(keys=self._keys(model, version),
                                     args=[self.failures, self.window_ms, self.open_ms, probe or "",
                                           secrets.token_hex(8), STATE_TTL_MS])
        self.moved(model, version, entered)

    async def succeeded(self, model: str, version: str, probe: str) -> None:
        """The probe got its first token: the version serves again."""
        self.moved(model, version, await self._succeeded(keys=self._keys(model, version), args=[probe]))

    async def closed(self, model: str, version: str) -> bool:
        return not self.enabled or not await self.redis.exists(names.breaker_state(model, version))

    async def states(self, versions: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
        """The state of each (model, version), in one pipeline (no hash: closed)."""
        pipe = self.redis.pipeline(transaction=False)
        for model, version in versions:
            pipe.hget(names.breaker_state(model, version), "state")
        found = await pipe.execute()
        return {mv: (s.decode() if s else CLOSED) for mv, s in zip(versions, found)}

    @staticmethod
    def _keys(model: str, version: str) -> list[str]:
        return [names.breaker_state(model, version), names.breaker_failures(model, version)]

    @staticmethod
    def moved(model: str, version: str, entered: bytes | str) -> None:
        to = entered.decode() if isinstance(entered, bytes) else entered
        if to:
            TRANSITIONS.labels(model, version, to).inc()
            log.warning("circuit breaker of %s version %s: %s", model, version, to.replace("_", "-"))


def counts_against(exc: KvgateError) -> bool:
    """What the version is to blame for: a 5xx or a timeout — but a request that failed alone while
    the engine served the rest (`request_failed`): its content is the likelier cause, and counting
    it would let one tenant's requests open the breaker for every tenant."""
    return exc.status >= 500 and exc.code != RequestFailed.code
