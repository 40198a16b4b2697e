"""Stored responses (`store: true`, the default): each kept under its key's hash tag with a TTL, the
response as returned and the conversation it ended (what `previous_response_id` continues from).
The key id is part of every name, so one key can never read, continue or delete another's: its id
names nothing there (404).

The size quota: per key, a hash (`names.stored_responses`, response id -> `bytes:expiry`), the
same ids in a sorted set by expiry (`names.stored_response_expiries`) and their total
(`names.stored_response_bytes`), changed together by one script as a response is stored, deleted
or found expired. A response is counted exactly while it is in the sorted set, so the total cannot
drift, and no check reads more than the expired entries it drops (at most DROP a call): summing the
hash on every request held Redis, and every tenant on it, 0.33 s a request for a key that kept
330,000 small responses (within the 256 MiB default). A hash without a total (written before it
existed) is counted once, in full. A request is refused up front when its key is at its quota; a
response is stored once it is done, so N requests of a key racing at the edge may pass it by N
responses. More than DROP responses expiring at once are dropped over as many checks, the quota
counting them meanwhile (stricter, never looser).
"""
from __future__ import annotations

import time

import orjson
import redis.asyncio as aioredis

from shared import names

DROP = 1000  # expired responses one check drops at most (~1 ms of Redis)

# KEYS: the quota hash, the expiry set, the total (then what a script adds). ARGV: now, ttl (s).
# A total that does not exist is made from the hash, once; each of the three keeps the longest
# TTL it was given. `uncount` takes one response out of all three.
COUNTED = """
local function counted(now, ttl)
  if redis.call('EXISTS', KEYS[3]) == 0 then
    local used, fields = 0, redis.call('HGETALL', KEYS[1])
    for i = 1, #fields, 2 do
      local size, expiry = string.match(fields[i + 1], '^(%d+):(%d+)$')
      if size and tonumber(expiry) > now then
        used = used + tonumber(size)
        redis.call('ZADD', KEYS[2], expiry, fields[i])
      else redis.call('HDEL', KEYS[1], fields[i]) end
    end
    redis.call('SET', KEYS[3], used)
  end
  for i = 1, 3 do
    if redis.call('EXISTS', KEYS[i]) == 1 and redis.call('TTL', KEYS[i]) < ttl then
      redis.call('EXPIRE', KEYS[i], ttl)
    end
  end
end
local function uncount(id)
  if redis.call('ZREM', KEYS[2], id) == 1 then
    local v = redis.call('HGET', KEYS[1], id)
    if v then redis.call('DECRBY', KEYS[3], tonumber(string.match(v, '^(%d+):'))) end
  end
  redis.call('HDEL', KEYS[1], id)
end
"""

# Drops up to DROP expired responses; answers the bytes still kept.
USED = COUNTED + """
local now = tonumber(ARGV[1])
counted(now, tonumber(ARGV[2]))
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, %d)) do
  uncount(id)
end
return tonumber(redis.call('GET', KEYS[3]))
""" % DROP

# KEYS[4]: the response. ARGV[3..5]: its id, its JSON, its expiry (unix s).
STORE = COUNTED + """
counted(tonumber(ARGV[1]), tonumber(ARGV[2]))
uncount(ARGV[3])
redis.call('SET', KEYS[4], ARGV[4], 'EX', ARGV[2])
redis.call('HSET', KEYS[1], ARGV[3], string.len(ARGV[4]) .. ':' .. ARGV[5])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[3])
redis.call('INCRBY', KEYS[3], string.len(ARGV[4]))
counted(tonumber(ARGV[1]), tonumber(ARGV[2]))
return 1
"""

# KEYS[4]: the response. ARGV[3]: its id. Answers 1 when it was there.
DELETE = COUNTED + """
counted(tonumber(ARGV[1]), tonumber(ARGV[2]))
uncount(ARGV[3])
return redis.call('DEL', KEYS[4])
"""


class ResponseStore:
    def __init__(self, redis: aioredis.Redis, retention_s: float):
        self.redis, self.retention_s = redis, int(retention_s)
        self._used = redis.register_script(USED)
        self._store = redis.register_script(STORE)
        self._delete = redis.register_script(DELETE)

    async def used(self, key_id: str) -> int:
        """Bytes the key keeps in stored responses now."""
        return int(await self._used(keys=_quota(key_id), args=[int(time.time()), self.retention_s]))

    async def put(self, key_id: str, response: dict, conversation: list[dict]) -> None:
        raw = orjson.dumps({"response": response, "conversation": conversation})
        now = int(time.time())
        await self._store(keys=[*_quota(key_id), names.stored_response(key_id, response["id"])],
                          args=[now, self.retention_s, response["id"], raw, now + self.retention_s])

    async def get(self, key_id: str, response_id: str) -> dict | None:
        """{"response", "conversation"}, or None (never stored, expired, deleted, another key's)."""
        raw = await self.redis.get(names.stored_response(key_id, response_id))
        return orjson.loads(raw) if raw else None

    async def delete(self, key_id: str, response_id: str) -> bool:
        gone = await self._delete(keys=[*_quota(key_id), names.stored_response(key_id, response_id)],
                                  args=[int(time.time()), self.retention_s, response_id])
        return bool(gone)


def _quota(key_id: str) -> list[str]:
    """The three keys of a key's response quota, in the order the scripts read them."""
    return [names.stored_responses(key_id), names.stored_response_expiries(key_id),
            names.stored_response_bytes(key_id)]
