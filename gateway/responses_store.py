"""Stored responses (`store: true`, the default): each kept under its key's hash tag with a TTL, the
response as returned and the conversation it ended (what `previous_response_id` continues from).
The key id is part of every name, so one key can never read, continue or delete another's: its id
names nothing there (404).

The size quota is one hash per key (`names.stored_responses`), an entry per response,
`bytes:expiry`; use is the sum of the live entries, so it cannot drift (an expired entry is dropped
by the next store). A request is refused up front when its key is at its quota; a response is
stored once it is done, so N requests of a key racing at the edge may pass it by N responses.
"""
from __future__ import annotations

import time

import orjson
import redis.asyncio as aioredis

from shared import names

# KEYS: the key's quota hash. ARGV: now. Drops expired entries; answers the bytes still kept.
USED = """
local now, used = tonumber(ARGV[1]), 0
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  local size, expiry = string.match(fields[i + 1], '^(%d+):(%d+)$')
  if tonumber(expiry) > now then used = used + tonumber(size)
  else redis.call('HDEL', KEYS[1], fields[i]) end
end
return used
"""

# KEYS: the response, the key's quota hash. ARGV: id, JSON, ttl (s), expiry (unix s).
STORE = """
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
redis.call('HSET', KEYS[2], ARGV[1], string.len(ARGV[2]) .. ':' .. ARGV[4])
if redis.call('TTL', KEYS[2]) < tonumber(ARGV[3]) then redis.call('EXPIRE', KEYS[2], ARGV[3]) end
return 1
"""

# KEYS: the response, the key's quota hash. ARGV: id. Answers 1 when it was there.
DELETE = """
redis.call('HDEL', KEYS[2], ARGV[1])
return redis.call('DEL', KEYS[1])
"""


class ResponseStore:
    def __init__(self, redis: aioredis.Redis, retention_s: float):
        self.redis, self.retention_s = redis, int(retention_s)
        self._used = redis.register_script(USED)
        self._store = redis.register_script(STORE)
        self._delete = redis.register_script(DELETE)

    async def used(self, key_id: str) -> int:
        """Bytes the key keeps in stored responses now."""
        return int(await self._used(keys=[names.stored_responses(key_id)], args=[int(time.time())]))

    async def put(self, key_id: str, response: dict, conversation: list[dict]) -> None:
        raw = orjson.dumps({"response": response, "conversation": conversation})
        expiry = int(time.time()) + self.retention_s
        await self._store(keys=[names.stored_response(key_id, response["id"]),
                                names.stored_responses(key_id)],
                          args=[response["id"], raw, self.retention_s, expiry])

    async def get(self, key_id: str, response_id: str) -> dict | None:
        """{"response", "conversation"}, or None (never stored, expired, deleted, another key's)."""
        raw = await self.redis.get(names.stored_response(key_id, response_id))
        return orjson.loads(raw) if raw else None

    async def delete(self, key_id: str, response_id: str) -> bool:
        gone = await self._delete(keys=[names.stored_response(key_id, response_id),
                                        names.stored_responses(key_id)], args=[response_id])
        return bool(gone)
