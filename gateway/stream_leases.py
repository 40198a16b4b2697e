"""Streams that survive their gateway: once a stream's 200 goes out, what its request holds (its
key's slot, its token reservation, the usage to record; gateway/holdings.py) is written to Redis as
the stream's lease, so whichever gateway its client is connected to at the end settles it, once.

Who settles, exactly:
- the gateway serving the client when the stream ends (done, or an error event) claims the lease
  and settles it with what the client received;
- a client that goes away: its gateway lets the lease go (held for `KVGATE_RESUME_GRACE_S` more);
  a resume at any gateway within that time takes it over (`attach`) and settles it at its end;
- a lease nobody holds any more (its client did not come back; its gateway died, so its holds,
  refreshed every REFRESH_S, lapsed HOLD_S after its last refresh): the sweeper every gateway runs
  claims it, cancels its request and settles it: the usage of the reply log's `done` if the
  request finished meanwhile, else as a client that left (the reservation stands, an error counted).
A claim is one Lua script on the lease's hash (sets `settled` only if unset, and only once the hold
lapsed unless the holder itself claims), so settlement happens once however many gateways race.
`until` is written with the gateways' clocks; the sweeper allows them SKEW_S of disagreement.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import orjson
import redis.asyncio as aioredis

from gateway.holdings import Holdings, settle, settle_call
from gateway.limits import SETTLE_FN, Limits
from shared import names, protocol
from shared.redis_client import is_cluster
from shared.usage import UsageBook

log = logging.getLogger("kvgate.gateway")
REFRESH_S = 1.0  # how often a gateway renews its holds and sweeps lapsed ones
HOLD_S = 5.0  # a hold outlives its last renewal by this (plus the grace): a dead gateway's lapse
SKEW_S = 1.0  # clock disagreement between gateways the sweeper allows before it claims
SETTLED_TTL_S = 120  # a settled lease still answers a late resume (the reply log keeps 60 s)
SWEEP_BATCH = 100
RESUME_WINDOW_S = 60  # resumes of one stream are counted per this window (KVGATE_MAX_RESUMES_PER_MINUTE)
ABANDONED = "abandoned"  # `settled` of a lease whose client never came back: its request was cancelled


class Attach(IntEnum):
    """What ATTACH answers."""

    GONE = -1  # no such lease (never, another key's, or expired)
    SETTLED = 0  # over and settled: a resume only reads what is left of the reply log
    HELD = 1  # now held by this gateway, which settles it at the end


# KEYS: lease. ARGV: holder, until.
ATTACH = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HEXISTS', KEYS[1], 'settled') == 1 then return 0 end
redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'until', ARGV[2])
return 1
"""
# KEYS: lease. ARGV: holder, until. Renews (or shortens, on a let-go) only the holder's own hold.
RENEW = """
if redis.call('HGET', KEYS[1], 'holder') ~= ARGV[1] then return 0 end
if redis.call('HEXISTS', KEYS[1], 'settled') == 1 then return 0 end
redis.call('HSET', KEYS[1], 'until', ARGV[2])
return 1
"""
# KEYS: lease. ARGV: the attempt's request id (a lease that expired is not made again, untimed).
FOLLOW = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'follow', ARGV[1]) end
return 1
"""
# The lease settled as ARGV's `as_` by whoever calls: answers -1 (gone), 0 (settled already), -2
# (still held, when the hold is honoured: '1') or the lease's fields (won).
CLAIM_FN = """
local function claim(lease, as_, now, honour, ttl)
  if redis.call('EXISTS', lease) == 0 then return -1 end
  if redis.call('HEXISTS', lease, 'settled') == 1 then return 0 end
  if honour == '1' and tonumber(redis.call('HGET', lease, 'until') or '0') > tonumber(now) then
    return -2
  end
  redis.call('HSET', lease, 'settled', as_)
  redis.call('EXPIRE', lease, ttl)
  return redis.call('HGETALL', lease)
end
"""
# KEYS: lease. ARGV: settled-as, now, honour the hold (1) or not (0: the holder claims), TTL.
CLAIM = CLAIM_FN + """
return claim(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
"""
# The holder's end of a stream in one Redis: its lease claimed, out of the open streams, and if
# this call won, its holdings settled (gateway/limits.py SETTLE_FN, from KEYS[3] and ARGV[4]).
# KEYS: lease, open streams, then SETTLE_FN's. ARGV: settled-as, TTL, open-streams member, then
# SETTLE_FN's. Answers 1 when it settled, else 0.
CLAIM_SETTLE = CLAIM_FN + SETTLE_FN + """
local got = claim(KEYS[1], ARGV[1], '0', '0', ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[3])
if type(got) ~= 'table' then return 0 end
settle(2, 3)
return 1
"""


@dataclass(frozen=True)
class StreamLease:
    key_id: str
    request_id: str

    @property
    def name(self) -> str:
        return names.stream_lease(self.key_id, self.request_id)

    @property
    def member(self) -> str:
        return f"{self.key_id}/{self.request_id}"

    @classmethod
    def of_member(cls, member: bytes) -> StreamLease:
        key_id, _, request_id = member.decode().rpartition("/")
        return cls(key_id, request_id)


def _decoded(raw) -> dict[str, str]:
    items = raw.items() if isinstance(raw, dict) else zip(raw[::2], raw[1::2])
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in items}


class StreamLeases:
    def __init__(self, redis: aioredis.Redis, gateway_id: str, grace_s: float, limits: Limits,
                 book: UsageBook, cancel: Callable[[str, str], None]):
        self.redis, self.me, self.grace_s = redis, gateway_id, grace_s
        self.limits, self.book, self.cancel = limits, book, cancel
        self.held: set[StreamLease] = set()  # leases whose client this process serves now
        self._attach = redis.register_script(ATTACH)
        self._renew = redis.register_script(RENEW)
        self._claim = redis.register_script(CLAIM)
        self._claim_settle = redis.register_script(CLAIM_SETTLE)
        self._follow = redis.register_script(FOLLOW)
        self._loop: asyncio.Task | None = None

    async def start(self) -> None:
        self._loop = asyncio.create_task(self._tend_forever())

    async def stop(self) -> None:
        if self._loop:
            self._loop.cancel()

    def _held_until(self) -> float:
        return time.time() + HOLD_S + self.grace_s

    async def open(self, lease: StreamLease, held: Holdings, deadline: float, shape: dict,
                   attempt_id: str) -> None:
        """Writes the lease, held by this gateway, before the stream's 200 goes out; `attempt_id`:
        the request id whose reply log a resume follows (a retry's, gateway/retry.py)."""
        until = self._held_until()
        fields = held.fields() | {"request_id": lease.request_id, "deadline": repr(deadline),
                                  "follow": attempt_id, "channel": names.reply_channel(self.me),
                                  "shape": orjson.dumps(shape), "holder": self.me, "until": repr(until)}
        pipe = self.redis.pipeline(transaction=False)  # one round trip on the first token's path
        pipe.hset(lease.name, mapping=fields)
        pipe.expireat(lease.name, int(deadline + HOLD_S + self.grace_s + SETTLED_TTL_S))
        pipe.zadd(names.OPEN_STREAMS, {lease.member: until})
        await pipe.execute()
        self.held.add(lease)

    async def follow(self, lease: StreamLease, attempt_id: str) -> None:
        """The request was sent again (before its first token) as `attempt_id`: resumes read its log."""
        await self._follow(keys=[lease.name], args=[attempt_id])

    async def find(self, lease: StreamLease) -> dict[str, str] | None:
        raw = await self.redis.hgetall(lease.name)
        return _decoded(raw) if raw else None

    async def resumed(self, lease: StreamLease) -> tuple[int, int]:
        """This stream's resumes in the minute since the first of them, this one counted, and the
        seconds left of that minute (one round trip)."""
        name = names.stream_resumes(lease.key_id, lease.request_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(name, 0, ex=RESUME_WINDOW_S, nx=True)
            pipe.incr(name)
            pipe.ttl(name)
            _, count, left = await pipe.execute()
        return int(count), max(int(left), 1)

    async def attach(self, lease: StreamLease) -> Attach:
        """A resumed client is served here now: this gateway holds (and will settle) its lease."""
        until = self._held_until()
        got = Attach(await self._attach(keys=[lease.name], args=[self.me, repr(until)]))
        if got == Attach.HELD:
            self.held.add(lease)
            await self.redis.zadd(names.OPEN_STREAMS, {lease.member: until})
        return got

    async def let_go(self, lease: StreamLease) -> None:
        """The client went away mid-stream: its request runs on for the grace, then is swept."""
        self.held.discard(lease)
        until = time.time() + self.grace_s
        if await self._renew(keys=[lease.name], args=[self.me, repr(until)]):
            await self.redis.zadd(names.OPEN_STREAMS, {lease.member: until}, xx=True)

    async def claim(self, lease: StreamLease, as_: str, honour_hold: bool) -> Holdings | None:
        """The lease's holdings if this call won the right to settle them, else None."""
        self.held.discard(lease)
        got = await self._claim(keys=[lease.name], args=[as_, repr(time.time()),
                                                         "1" if honour_hold else "0", SETTLED_TTL_S])
        if got == -2:
            return None
        await self.redis.zrem(names.OPEN_STREAMS, lease.member)
        return Holdings.from_fields(_decoded(got)) if isinstance(got, list) else None

    async def end(self, lease: StreamLease, as_: str, held: Holdings, usage: dict | None,
                  refused: bool) -> bool:
        """The holder saw its stream end (`as_`): the lease claimed and, if this call won, `held`
        settled with `usage`; whether it settled. One script in one Redis; a claim, then the
        settlement, in a cluster (its keys are in other slots)."""
        call = None if is_cluster(self.redis) else settle_call(self.book, held, usage, refused)
        if call is None:
            if await self.claim(lease, as_, honour_hold=False) is None:
                return False
            await settle(self.limits, self.book, held, usage, refused)
            return True
        self.held.discard(lease)
        keys, args = call
        return bool(await self._claim_settle(keys=[lease.name, names.OPEN_STREAMS, *keys],
                                             args=[as_, SETTLED_TTL_S, lease.member, *args]))

    async def _tend_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                await self.renew()
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: the holds outlive a few missed renewals
                log.warning("stream leases: %s", type(exc).__name__)

    async def renew(self) -> None:
        held = list(self.held)
        if not held:
            return
        until = self._held_until()
        pipe = self.redis.pipeline(transaction=False)
        for lease in held:
            await self._renew(keys=[lease.name], args=[self.me, repr(until)], client=pipe)  # queued
        renewed = await pipe.execute()
        mine = {lease.member: until for lease, ok in zip(held, renewed) if ok}
        self.held.difference_update(lease for lease, ok in zip(held, renewed) if not ok)
        if mine:
            await self.redis.zadd(names.OPEN_STREAMS, mine, xx=True)

    async def sweep(self) -> int:
        """Settles the leases nobody holds any more; how many this call settled."""
        lapsed = await self.redis.zrangebyscore(names.OPEN_STREAMS, "-inf", time.time() - SKEW_S,
                                                start=0, num=SWEEP_BATCH)
        settled = 0
        for member in lapsed:
            lease = StreamLease.of_member(member)
            settled += await self._settle_lapsed(lease)
        return settled

    async def _settle_lapsed(self, lease: StreamLease) -> int:
        follow = await self.redis.hget(lease.name, "follow")
        attempt_id = follow.decode() if follow else lease.request_id
        end, tokens = await _end_of(self.redis, attempt_id)
        held = await self.claim(lease, "done" if isinstance(end, protocol.Done) else ABANDONED,
                                honour_hold=True)
        if held is None:
            return 0
        if end is None:  # still queued or running: nobody is left to read it
            self.cancel(attempt_id, "client_gone")
        usage = _usage(end) if isinstance(end, protocol.Done) else None
        refused = isinstance(end, protocol.ErrorReply) and tokens == 0
        await settle(self.limits, self.book, held, usage, refused)
        log.info("settled stream %s of key %s nobody holds (%s)", lease.request_id, lease.key_id,
                 "done" if usage else "client gone")
        return 1


async def _end_of(redis: aioredis.Redis, request_id: str) -> tuple[object | None, int]:
    """The request's last reply (done or error) if its reply log has one, else None; and the
    tokens the log shows were produced."""
    end, tokens = None, 0
    for raw in await redis.lrange(names.checkpoint_key(request_id), 0, -1):
        try:
            reply = protocol.decode_reply(raw)
        except ValueError:  # another release's line: counts as nothing here
            continue
        if isinstance(reply, protocol.Delta):
            tokens += len(reply.token_ids)
        else:
            end = reply
    return end, tokens


def _usage(done: protocol.Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}
