"""API keys in Redis: records by id, ids by name, ids by secret digest. No secret is ever stored.

Every write of an existing key is a read-modify-write under WATCH/MULTI: the record is read, the
change applied in Python, and the transaction commits only if nobody wrote the key in between (else
it reads again). So a PATCH that races a revoke applies to the revoked record, never over it, and
of two rotations the second expires the first one's secret. (The JSON is merged in Python, not in
Lua: Lua's cjson keeps 14 significant digits of a number.)

A gateway keeps the records it looked up for `cache_s` (KVGATE_KEY_CACHE_S), which takes the key
lookup off the request path. Every write publishes the key's id on KEYS_CHANGED_CHANNEL; each
gateway drops that key's records as the message arrives (its own writes drop them before they
return), and all of them when its subscription is renewed, so a revoke, a PATCH or a rotation
reaches every replica as fast as a pub/sub message; `cache_s` only bounds what a missed message
could keep (a write made outside KeyStore, a subscription lost and not yet renewed). A rotated-out
secret is kept no longer than its digest lives in Redis. Unknown secrets are never cached.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from gateway.keys import KeyRecord, digest, new_key_id, new_secret
from shared import names
from shared.redis_client import is_cluster
from shared.errors import Conflict, NotFound

WRITE_RETRIES = 100  # every retry means another write committed: N racing writers need < N

# One round trip from a digest to the record and to how long the digest lives (-1: for good).
LOOKUP = """
local id = redis.call('GET', KEYS[1])
if not id then return false end
return {redis.call('HGET', '%s:' .. id, 'record'), redis.call('PTTL', KEYS[1])}
""" % names.key_record("").rstrip(":")
CACHED_KEYS = 4096  # records one gateway keeps (the least recently used go first)

NAME_TAKEN, CREATED = 0, 1  # what CREATE answers

# KEYS: name index, record hash, digest key. ARGV: name, id, record JSON, digest.
CREATE = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return %(taken)d end
redis.call('HSET', KEYS[2], 'record', ARGV[3], 'digest', ARGV[4])
redis.call('SET', KEYS[3], ARGV[2])
return %(created)d
""" % {"taken": NAME_TAKEN, "created": CREATED}


def _not_found(name_or_id: str) -> NotFound:
    return NotFound(f"No API key named '{name_or_id}'", param="key", code="key_not_found")


class KeyStore:
    def __init__(self, redis: aioredis.Redis, server_secret: str, cache_s: float = 0.0,
                 live: Callable[[], bool] = lambda: False):
        self.redis = redis
        self._server_secret = server_secret
        self._lookup = redis.register_script(LOOKUP)
        self._create = redis.register_script(CREATE)
        self.cache_s = cache_s
        self.live = live  # whether changes reach this process now (its subscription is up): else no cache
        self._cache: OrderedDict[str, tuple[KeyRecord, float]] = OrderedDict()  # digest -> (record, until)
        self._epoch = 0  # moved by every forget: a lookup begun before one does not cache what it read

    def digest(self, secret: str) -> str:
        return digest(self._server_secret, secret)

    async def lookup(self, secret: str) -> KeyRecord | None:
        d = self.digest(secret)
        live = self.cache_s > 0 and self.live()
        if live and (hit := self._cache.get(d)) is not None:
            if hit[1] > time.monotonic():
                self._cache.move_to_end(d)
                return hit[0]
            del self._cache[d]
        epoch = self._epoch
        raw, ttl_ms = await self._read(names.key_digest(d), ttl=live)
        if not raw:
            return None
        record = KeyRecord.model_validate_json(raw)
        if live and epoch == self._epoch and ttl_ms != -2:  # -2: the digest went meanwhile
            keep = self.cache_s if ttl_ms == -1 else min(self.cache_s, ttl_ms / 1000)
            self._cache[d] = (record, time.monotonic() + keep)
            if len(self._cache) > CACHED_KEYS:
                self._cache.popitem(last=False)
        return record

    async def _read(self, digest_key: str, ttl: bool) -> tuple[bytes | None, int]:
        """The record a digest names and the digest's remaining life in ms (-1: no expiry; read on
        a cluster only when `ttl`, for a copy to be kept)."""
        if is_cluster(self.redis):  # digest and record in two slots: two reads (a revoke between is read)
            # single commands, not a pipeline: redis-py's cluster pipeline can fail with an
            # AttributeError on a connection it opens during a failover (tests/cluster/test_failover.py)
            key_id = await self.redis.get(digest_key)
            raw = key_id and await self.redis.hget(names.key_record(key_id.decode()), "record")
            ttl_ms = await self.redis.pttl(digest_key) if raw and ttl else -2
        else:  # one round trip
            found = await self._lookup(keys=[digest_key])
            raw, ttl_ms = found if found else (None, -2)
        return raw, int(ttl_ms)

    def forget(self, key_id: str | None = None) -> None:
        """Drops the cached records of `key_id` (None: all of them)."""
        self._epoch += 1
        if key_id is None:
            self._cache.clear()
            return
        for d in [d for d, (record, _) in self._cache.items() if record.id == key_id]:
            del self._cache[d]

    def on_changed(self, message: bytes) -> None:
        """A KEYS_CHANGED_CHANNEL message: the id of a key written somewhere."""
        self.forget(message.decode(errors="replace"))

    async def _changed(self, key_id: str) -> None:
        """After a write: this process's copies go now, every other gateway's as the message lands."""
        self.forget(key_id)
        try:
            await self.redis.publish(names.KEYS_CHANGED_CHANNEL, key_id)
        except Exception:  # the write stands; the others' copies expire within cache_s
            pass

    async def create(self, record: KeyRecord) -> tuple[KeyRecord, str]:
        """Store a new key (its name must be free); the secret is returned once, here."""
        secret = new_secret()
        d = self.digest(secret)
        keys = [names.KEY_NAMES, names.key_record(record.id), names.key_digest(d)]
        args = [record.name, record.id, record.model_dump_json(), d]
        outcome = await (self._create_in_steps(keys, args) if is_cluster(self.redis)
                         else self._create(keys=keys, args=args))
        if outcome == NAME_TAKEN:
            raise Conflict(f"A key named '{record.name}' already exists", param="name")
        return record, secret

    async def _create_in_steps(self, keys: list[str], args: list[str]) -> int:
        """CREATE over three slots: the name, the record, the digest last. A failure before the
        digest leaves a name whose key has no secret anyone holds: unusable, never a wrong grant."""
        names_key, record_key, digest_key = keys
        name, key_id, record, d = args
        if not await self.redis.hsetnx(names_key, name, key_id):
            return NAME_TAKEN
        await self.redis.hset(record_key, mapping={"record": record, "digest": d})
        await self.redis.set(digest_key, key_id)
        return CREATED

    async def resolve(self, name_or_id: str) -> str:
        key_id = await self.redis.hget(names.KEY_NAMES, name_or_id)
        if key_id is not None:
            return key_id.decode()
        if await self.redis.exists(names.key_record(name_or_id)):
            return name_or_id
        raise _not_found(name_or_id)

    async def get(self, name_or_id: str) -> KeyRecord:
        record = await self.by_id(await self.resolve(name_or_id))
        if record is None:
            raise _not_found(name_or_id)
        return record

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

    async def update(self, key_id: str, edit: Callable[[KeyRecord], KeyRecord]) -> KeyRecord:
        """Apply `edit` to the record as it is now and store the result; a rename moves the name
        index in the same transaction (the new name must be free)."""
        try:
            return await self._update(key_id, edit)
        finally:
            await self._changed(key_id)

    async def _update(self, key_id: str, edit: Callable[[KeyRecord], KeyRecord]) -> KeyRecord:
        if is_cluster(self.redis):  # the name index is in another slot
            return await self._update_in_steps(key_id, edit)
        record_key = names.key_record(key_id)
        for _ in range(WRITE_RETRIES):
            async with self.redis.pipeline(transaction=True) as pipe:
                await pipe.watch(record_key)
                old = _parsed(await pipe.hget(record_key, "record"), key_id)
                new = edit(old)
                if new == old:
                    return old
                if new.name != old.name:
                    await self._claim_name(pipe, new)
                pipe.multi()
                if new.name != old.name:
                    pipe.hset(names.KEY_NAMES, new.name, key_id)
                    pipe.hdel(names.KEY_NAMES, old.name)
                pipe.hset(record_key, "record", new.model_dump_json())
                if await _committed(pipe):
                    return new
        raise _busy(key_id)

    async def _update_in_steps(self, key_id: str, edit: Callable[[KeyRecord], KeyRecord]) -> KeyRecord:
        """`update` over two slots: a new name is claimed first, the record committed (WATCH on it
        alone), then the old name dropped. A failure between leaves an extra name for the same key."""
        record_key = names.key_record(key_id)
        for _ in range(WRITE_RETRIES):
            async with self.redis.pipeline(transaction=True) as pipe:
                await pipe.watch(record_key)
                old = _parsed(await pipe.hget(record_key, "record"), key_id)
                new = edit(old)
                if new == old:
                    return old
                if new.name != old.name:
                    await self._claim_name_alone(new)
                pipe.multi()
                pipe.hset(record_key, "record", new.model_dump_json())
                if await _committed(pipe):
                    if new.name != old.name:
                        await self._drop_name(old.name, key_id)
                    return new
        raise _busy(key_id)

    async def _claim_name_alone(self, new: KeyRecord) -> None:
        if not await self.redis.hsetnx(names.KEY_NAMES, new.name, new.id):
            holder = await self.redis.hget(names.KEY_NAMES, new.name)
            if holder is not None and holder.decode() != new.id:
                raise Conflict(f"A key named '{new.name}' already exists", param="name")

    async def _drop_name(self, name: str, key_id: str) -> None:
        """Only while it still names this key (a concurrent create may have taken it since)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            await pipe.watch(names.KEY_NAMES)
            if (holder := await pipe.hget(names.KEY_NAMES, name)) is None or holder.decode() != key_id:
                return
            pipe.multi()
            pipe.hdel(names.KEY_NAMES, name)
            await _committed(pipe)

    async def revoke(self, key_id: str) -> KeyRecord:
        """Revoked at once on every replica (each drops its copy as the change is published); the
        record stays for audit."""
        def revoked(record: KeyRecord) -> KeyRecord:
            if record.status == "revoked":
                return record
            return record.model_copy(update={"status": "revoked", "revoked": time.time()})
        return await self.update(key_id, revoked)

    async def rotate(self, key_id: str, grace_s: int) -> tuple[KeyRecord, str]:
        """A new secret; the current one keeps working for `grace_s` seconds, then its digest
        expires (0: at once). Rotated-out digests always carry a TTL; only the current has none."""
        try:
            return await self._rotate(key_id, grace_s)
        finally:
            await self._changed(key_id)

    async def _rotate(self, key_id: str, grace_s: int) -> tuple[KeyRecord, str]:
        secret = new_secret()
        d = self.digest(secret)
        record_key = names.key_record(key_id)
        if is_cluster(self.redis):  # record and digests in three slots
            return await self._rotate_in_steps(key_id, secret, d, grace_s)
        for _ in range(WRITE_RETRIES):
            async with self.redis.pipeline(transaction=True) as pipe:
                await pipe.watch(record_key)
                raw, current = await pipe.hmget(record_key, "record", "digest")
                rotated = _parsed(raw, key_id).model_copy(update={"rotated": time.time()})
                pipe.multi()
                if current is not None:
                    if grace_s > 0:
                        pipe.expire(names.key_digest(current.decode()), grace_s)
                    else:
                        pipe.delete(names.key_digest(current.decode()))
                pipe.set(names.key_digest(d), key_id)
                pipe.hset(record_key, mapping={"record": rotated.model_dump_json(), "digest": d})
                if await _committed(pipe):
                    return rotated, secret
        raise _busy(key_id)

    async def _rotate_in_steps(self, key_id: str, secret: str, d: str, grace_s: int) -> tuple[KeyRecord, str]:
        """`rotate` over three slots: the new digest first (its secret is not handed out yet), the
        record (WATCH on it alone), then the old digest's expiry. A failure leaves a digest of a
        secret nobody has, or the old secret valid longer; never a secret that should not work."""
        record_key = names.key_record(key_id)
        if not await self.redis.exists(record_key):
            raise _not_found(key_id)
        await self.redis.set(names.key_digest(d), key_id)
        for _ in range(WRITE_RETRIES):
            async with self.redis.pipeline(transaction=True) as pipe:
                await pipe.watch(record_key)
                raw, current = await pipe.hmget(record_key, "record", "digest")
                rotated = _parsed(raw, key_id).model_copy(update={"rotated": time.time()})
                pipe.multi()
                pipe.hset(record_key, mapping={"record": rotated.model_dump_json(), "digest": d})
                if await _committed(pipe):
                    if current is not None and grace_s > 0:
                        await self.redis.expire(names.key_digest(current.decode()), grace_s)
                    elif current is not None:
                        await self.redis.delete(names.key_digest(current.decode()))
                    return rotated, secret
        await self.redis.delete(names.key_digest(d))  # never handed out
        raise _busy(key_id)

    @staticmethod
    async def _claim_name(pipe, new: KeyRecord) -> None:
        """Watch the name index and check the new name is free (or already this key's)."""
        await pipe.watch(names.KEY_NAMES)
        holder = await pipe.hget(names.KEY_NAMES, new.name)
        if holder is not None and holder.decode() != new.id:
            raise Conflict(f"A key named '{new.name}' already exists", param="name")

    @staticmethod
    def new_record(**fields) -> KeyRecord:
        return KeyRecord(id=new_key_id(), created=time.time(), **fields)


def _parsed(raw: bytes | None, key_id: str) -> KeyRecord:
    if raw is None:
        raise _not_found(key_id)
    return KeyRecord.model_validate_json(raw)


async def _committed(pipe) -> bool:
    """EXEC; False when a watched key changed since it was read (the caller reads again)."""
    try:
        await pipe.execute()
        return True
    except WatchError:
        return False


def _busy(key_id: str) -> Conflict:
    return Conflict(f"API key '{key_id}' kept changing under {WRITE_RETRIES} concurrent writes; "
                    "try again", param="key", code="concurrent_update")
