"""API keys in Redis: records by id, ids by name, ids by secret digest. No secret is ever stored."""
from __future__ import annotations

import time

import redis.asyncio as aioredis

from gateway.keys import KeyRecord, digest, new_key_id, new_secret
from shared import names
from shared.errors import Conflict, NotFound

# One round trip from a digest to the record, so no gateway needs a cache that could hide a revoke.
LOOKUP = """
local id = redis.call('GET', KEYS[1])
if not id then return false end
return redis.call('HGET', '%s:' .. id, 'record')
""" % names.key_record("").rstrip(":")

# KEYS: name index, record hash, digest key. ARGV: name, id, record JSON, digest. 0: name taken.
CREATE = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HSET', KEYS[2], 'record', ARGV[3], 'digest', ARGV[4])
redis.call('SET', KEYS[3], ARGV[2])
return 1
"""


class KeyStore:
    def __init__(self, redis: aioredis.Redis, server_secret: str):
        self.redis = redis
        self._server_secret = server_secret
        self._lookup = redis.register_script(LOOKUP)
        self._create = redis.register_script(CREATE)

    def digest(self, secret: str) -> str:
        return digest(self._server_secret, secret)

    async def lookup(self, secret: str) -> KeyRecord | None:
        raw = await self._lookup(keys=[names.key_digest(self.digest(secret))])
        return KeyRecord.model_validate_json(raw) if raw else None

    async def create(self, record: KeyRecord) -> tuple[KeyRecord, str]:
        """Store a new key (its name must be free); the secret is returned once, here."""
        secret = new_secret()
        d = self.digest(secret)
        created = await self._create(
            keys=[names.KEY_NAMES, names.key_record(record.id), names.key_digest(d)],
            args=[record.name, record.id, record.model_dump_json(), d])
        if not created:
            raise Conflict(f"A key named '{record.name}' already exists", param="name")
        return record, secret

    async def resolve(self, name_or_id: str) -> str:
        key_id = await self.redis.hget(names.KEY_NAMES, name_or_id)
        if key_id is not None:
            return key_id.decode()
        if await self.redis.exists(names.key_record(name_or_id)):
            return name_or_id
        raise NotFound(f"No API key named '{name_or_id}'", param="key", code="key_not_found")

    async def get(self, name_or_id: str) -> KeyRecord:
        key_id = await self.resolve(name_or_id)
        raw = await self.redis.hget(names.key_record(key_id), "record")
        if raw is None:
            raise NotFound(f"No API key named '{name_or_id}'", param="key", code="key_not_found")
        return KeyRecord.model_validate_json(raw)

    async def by_id(self, key_id: str) -> KeyRecord | None:
        """The record of a key id (never a name): whose batch a batch line runs for."""
        raw = await self.redis.hget(names.key_record(key_id), "record")
        return KeyRecord.model_validate_json(raw) if raw else None

    async def list(self) -> list[KeyRecord]:
        ids = await self.redis.hvals(names.KEY_NAMES)
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for key_id in ids:
            pipe.hget(names.key_record(key_id.decode()), "record")
        records = [KeyRecord.model_validate_json(raw) for raw in await pipe.execute() if raw]
        return sorted(records, key=lambda r: (r.created, r.name))

    async def save(self, old: KeyRecord, new: KeyRecord) -> KeyRecord:
        """Write an updated record; a rename moves the name index (the new name must be free)."""
        if new.name != old.name:
            if not await self.redis.hsetnx(names.KEY_NAMES, new.name, new.id):
                raise Conflict(f"A key named '{new.name}' already exists", param="name")
            await self.redis.hdel(names.KEY_NAMES, old.name)
        await self.redis.hset(names.key_record(new.id), "record", new.model_dump_json())
        return new

    async def revoke(self, record: KeyRecord) -> KeyRecord:
        """Revoked at once on every replica (lookups read Redis); the record stays for audit."""
        if record.status == "revoked":
            return record
        return await self.save(record, record.model_copy(update={"status": "revoked",
                                                                 "revoked": time.time()}))

    async def rotate(self, record: KeyRecord, grace_s: int) -> tuple[KeyRecord, str]:
        """A new secret; the old one keeps working for `grace_s` seconds, then its digest expires."""
        secret = new_secret()
        d = self.digest(secret)
        old = await self.redis.hget(names.key_record(record.id), "digest")
        rotated = record.model_copy(update={"rotated": time.time()})
        pipe = self.redis.pipeline(transaction=True)
        if old is not None:
            if grace_s > 0:
                pipe.expire(names.key_digest(old.decode()), grace_s)
            else:
                pipe.delete(names.key_digest(old.decode()))
        pipe.set(names.key_digest(d), record.id)
        pipe.hset(names.key_record(record.id), mapping={"record": rotated.model_dump_json(), "digest": d})
        await pipe.execute()
        return rotated, secret

    @staticmethod
    def new_record(**fields) -> KeyRecord:
        return KeyRecord(id=new_key_id(), created=time.time(), **fields)
