"""Per-key quotas on what a key keeps: bytes stored and files (its uploads and its batches'
outputs), and batches in progress (not in a final status).

One Redis hash per key (`names.stored_by`) is the only record of use, one entry per thing:
`f:{file id}` -> the file's bytes, `u:{upload}` -> `bytes:expiry` of an upload still coming in,
`b:{batch id}` -> the unix time past which a batch no longer counts. Use is the sum of the entries,
so it cannot drift: an entry leaves in the same transaction that deletes its file (or ends its
batch), removing it twice removes nothing, and one left by a process that died mid-upload or
mid-create ages out at its expiry. A check and the entry it grants are one Lua script over that one
hash (one hash slot), so gateway replicas racing for the last bytes never overshoot.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared import names
from shared.errors import QuotaExceeded

# KEYS: the key's hash. ARGV: now, field, value, then what the field needs of each kind (bytes,
# files, batches) and each kind's limit (-1: none). The field is set (replacing what it held)
# unless a kind it asks more of would pass its limit. Expired holds are dropped on the way.
# Returns {HELD} when set, else {kind refused (1 bytes, 2 files, 3 batches: 1 + its index in
# KINDS), limit, used by the others}.
HELD = 0
HOLD = """
local now = tonumber(ARGV[1])
local used, old = {0, 0, 0}, {0, 0, 0}
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  local f, v = fields[i], fields[i + 1]
  local kind, share = string.sub(f, 1, 2), nil
  if kind == 'f:' then share = {tonumber(v), 1, 0}
  elseif kind == 'u:' then
    local size, expiry = string.match(v, '^(%d+):(%d+)$')
    if tonumber(expiry) > now then share = {tonumber(size), 1, 0}
    else redis.call('HDEL', KEYS[1], f) end
  elseif kind == 'b:' then
    if tonumber(v) > now then share = {0, 0, 1} else redis.call('HDEL', KEYS[1], f) end
  end
  if share then
    local into = (f == ARGV[2]) and old or used
    for k = 1, 3 do into[k] = into[k] + share[k] end
  end
end
for k = 1, 3 do
  local need, limit = tonumber(ARGV[3 + k]), tonumber(ARGV[6 + k])
  if limit >= 0 and need > old[k] and used[k] + need > limit then return {k, limit, used[k]} end
end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
return {0}
"""  # {0}: HELD (not formatted in: the script's patterns are full of %)

# KEYS: the key's hash. ARGV: now. Drops the holds past their expiry; how many went.
PRUNE = """
local gone = 0
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  local f, v = fields[i], fields[i + 1]
  local kind, expiry = string.sub(f, 1, 2), nil
  if kind == 'u:' then expiry = tonumber(string.match(v, ':(%d+)$'))
  elseif kind == 'b:' then expiry = tonumber(v) end
  if expiry and expiry <= tonumber(ARGV[1]) then
    redis.call('HDEL', KEYS[1], f)
    gone = gone + 1
  end
end
return gone
"""

KINDS = (("stored bytes", "max_stored_bytes", "Delete files to make room."),
         ("files", "max_files", "Delete files to make room."),
         ("batches in progress", "max_batches_in_progress",
          "Wait for a batch to finish, or cancel one."))  # (what, the key's field, what frees it)


@dataclass(frozen=True)
class QuotaLimits:
    """A key's quotas (None: no limit) and its name, which refusals are worded with."""

    who: str
    bytes: int | None = None
    files: int | None = None
    batches: int | None = None

    def args(self) -> list[int]:
        return [-1 if n is None else n for n in (self.bytes, self.files, self.batches)]


@dataclass(frozen=True)
class Usage:
    bytes: int
    files: int
    batches: int


def upload_field(token: str) -> str:
    return f"u:{token}"


def file_field(file_id: str) -> str:
    return f"f:{file_id}"


def batch_field(batch_id: str) -> str:
    return f"b:{batch_id}"


class Quota:
    def __init__(self, redis: aioredis.Redis):
        self.redis = redis
        self._hold = redis.register_script(HOLD)
        self._prune = redis.register_script(PRUNE)

    async def hold_upload(self, owner: str, token: str, nbytes: int, expires: float,
                          limits: QuotaLimits | None) -> None:
        """Hold `nbytes` and one file for an upload in progress (raised or lowered by a new call
        with the same token), or raise QuotaExceeded."""
        await self._check(owner, upload_field(token), f"{nbytes}:{int(expires)}", (nbytes, 1, 0),
                          limits, "file", "")

    async def hold_batch(self, owner: str, batch_id: str, until: float, limits: QuotaLimits | None,
                         room: tuple[int, int] = (1, 2)) -> None:
        """Count a new batch as in progress until it ends (or `until` passes), or raise
        QuotaExceeded; it also needs `room` (bytes, files) left for its output files."""
        await self._check(owner, batch_field(batch_id), str(int(until)), (*room, 1), limits, None,
                          " (a batch needs room for its output files)")

    async def release(self, owner: str, field: str) -> None:
        await self.redis.hdel(names.stored_by(owner), field)

    @staticmethod
    def store_file(pipe, owner: str, file_id: str, nbytes: int, upload: str | None = None) -> None:
        """In the transaction that records a file: its bytes count, and its upload's hold goes."""
        pipe.hset(names.stored_by(owner), file_field(file_id), nbytes)
        if upload is not None:
            pipe.hdel(names.stored_by(owner), upload_field(upload))

    @staticmethod
    def drop(pipe, owner: str, field: str) -> None:
        """In the transaction that deletes a file or ends a batch: it no longer counts."""
        pipe.hdel(names.stored_by(owner), field)

    async def prune(self, now: float | None = None) -> int:
        """Drop every key's holds past their expiry (a check drops its own key's on the way; this
        is for keys that check no more); how many went."""
        now = int(now or time.time())
        gone = 0
        async for key in self.redis.scan_iter(match=names.stored_by("*"), _type="hash"):
            gone += await self._prune(keys=[key], args=[now])
        return gone

    async def usage(self, owner: str, now: float | None = None) -> Usage:
        """What the key keeps now (live holds included), as the script counts it."""
        now = now or time.time()
        total = [0, 0, 0]
        for field, value in (await self.redis.hgetall(names.stored_by(owner))).items():
            kind, value = field[:2], value.decode()
            if kind == b"f:":
                total[0] += int(value)
                total[1] += 1
            elif kind == b"u:" and int(value.split(":")[1]) > now:
                total[0] += int(value.split(":")[0])
                total[1] += 1
            elif kind == b"b:" and int(value) > now:
                total[2] += 1
        return Usage(*total)

    async def _check(self, owner: str, field: str, value: str, need: tuple[int, int, int],
                     limits: QuotaLimits | None, param: str | None, why: str) -> None:
        args = limits.args() if limits is not None else [-1, -1, -1]
        refused = await self._hold(keys=[names.stored_by(owner)],
                                   args=[int(time.time()), field, value, *need, *args])
        if refused[0] != HELD:
            kind, limit, used = (int(x) for x in refused)
            label, name, advice = KINDS[kind - 1]
            raise QuotaExceeded(f"Quota exceeded for key '{limits.who}' on {label} ({name}): "
                                f"Limit {limit}, Used {used}, Requested {need[kind - 1]}{why}. "
                                f"{advice}", param=param)
