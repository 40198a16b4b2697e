"""Batch jobs (/v1/batches): OpenAI's batch object, its record in Redis, and the token its lines
carry. The gateway creates, shows and cancels batches; the Celery runner (services/batch.py) moves
them through their lifecycle:

    validating → in_progress → finalizing → completed
    validating → failed (the input file cannot be used at all)
    validating | in_progress → cancelling → cancelled
    validating | in_progress → expired (not done within the completion window)

Status changes are compare-and-set (a Lua script), so a cancel and the runner never undo each other.
A batch counts against its owner's quota of batches in progress (shared/quota.py) from its creation
until it reaches a final status.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from enum import IntEnum
from typing import Literal

import orjson
import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from shared import names, redis_client
from shared.errors import NotFound
from shared.quota import Quota, QuotaLimits, batch_field

Status = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired",
                 "cancelling", "cancelled"]
Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/v1/rerank"]
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "expired", "cancelled")
WINDOWS = {"24h": 86400}  # completion windows offered, in seconds (OpenAI's only one)
QUOTA_GRACE_S = 86400  # past its window a batch still counts this long (its runner expires it)
BATCH_PRIORITY = 1000  # engine priority of batch lines: after any interactive request (-100..100)
BATCH_TASK = "kvgate.batches.run"  # the Celery task that runs one batch
BATCH_QUEUE = "batches"  # its Celery queue (a Redis list under names.CELERY_PREFIX)
TOKEN_PREFIX = "kvgate-batch."
COUNTERS = ("total", "completed", "failed", "prompt_tokens", "completion_tokens")


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens: int = 0
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int = 0


class BatchObject(BaseModel):
    """OpenAI's batch object."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: Endpoint
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: Status
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    model: str | None = None
    usage: BatchUsage = Field(default_factory=BatchUsage)


class Batch(BatchObject):
    owner: str  # the key id that created it; its lines are governed as that key's requests
    max_stored_bytes: int | None = None  # the owner's byte quota when it was made: the runner
    # stops sending lines once their results would pass it (None: no quota)

    def public(self) -> BatchObject:
        return BatchObject.model_validate(self.model_dump(exclude={"owner", "max_stored_bytes"}))


_STATIC = ("id", "endpoint", "input_file_id", "completion_window", "created_at", "expires_at",
           "metadata", "owner", "max_stored_bytes")
_TIMES = tuple(f"{s}_at" for s in ("in_progress", "finalizing", "completed", "failed", "expired",
                                   "cancelling", "cancelled"))

STAYED, MOVED = 0, 1  # TRANSITION's first answer
# KEYS: batch hash. ARGV: new status, now, then the statuses it may move from.
# Returns {MOVED, new}, or {STAYED, current} (current is false for a missing batch).
TRANSITION = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return {%(stayed)d, false} end
for i = 3, #ARGV do
  if ARGV[i] == cur then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[1] .. '_at', ARGV[2])
    return {%(moved)d, ARGV[1]}
  end
end
return {%(stayed)d, cur}
""" % {"stayed": STAYED, "moved": MOVED}


class Acquired(IntEnum):
    """What ACQUIRE answers: whether a runner may run the batch."""

    ALL_BUSY = -1  # enough batches are running
    HELD_ELSEWHERE = 0  # another runner holds this batch
    OURS = 1  # the lease is ours


# KEYS: running zset. ARGV: batch id, now, lease expiry, most batches running at once.
ACQUIRE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return %(elsewhere)d end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then return %(busy)d end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
return %(ours)d
""" % {"busy": Acquired.ALL_BUSY, "elsewhere": Acquired.HELD_ELSEWHERE, "ours": Acquired.OURS}


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


def line_token(server_secret: str, batch_id: str) -> str:
    """The bearer token a batch's lines carry to the gateway: it names the batch, and only holders
    of the server secret can make it, so no key secret is ever kept to run a batch."""
    mac = hmac.new(server_secret.encode(), b"batch-line\0" + batch_id.encode(), hashlib.sha256)
    return f"{TOKEN_PREFIX}{batch_id}.{mac.hexdigest()}"


def token_batch(server_secret: str, token: str) -> str | None:
    """The batch id a line token speaks for, or None if it is not a valid one."""
    if not token.startswith(TOKEN_PREFIX):
        return None
    batch_id, _, _ = token[len(TOKEN_PREFIX):].rpartition(".")
    expected = line_token(server_secret, batch_id)
    return batch_id if batch_id and hmac.compare_digest(token.encode(), expected.encode()) else None


class BatchStore:
    def __init__(self, redis: aioredis.Redis, retention_s: float = 30 * 86400):
        self.redis = redis
        self.retention_s = retention_s
        self.quota = Quota(redis)
        self._transition = redis.register_script(TRANSITION)
        self._acquire = redis.register_script(ACQUIRE)

    async def create(self, owner: str, endpoint: str, input_file_id: str, completion_window: str,
                     metadata: dict[str, str] | None, limits: QuotaLimits | None = None) -> Batch:
        """A new batch, in `validating`, counted in progress first (429 if the owner's `limits`
        leave no room for it); its index entries outlive its record by a little, then go too.
        One transaction on one Redis; on a cluster the owner's list (`{k:}`), the record, then the
        active set, so a runner never meets an active id before its record (it would drop it), and
        a list entry without a record is skipped. A failure undoes the record and the hold."""
        now = int(time.time())
        batch = Batch(id=new_batch_id(), endpoint=endpoint, input_file_id=input_file_id,
                      completion_window=completion_window, status="validating", created_at=now,
                      expires_at=now + WINDOWS[completion_window], metadata=metadata, owner=owner,
                      max_stored_bytes=limits.bytes if limits is not None else None)
        await self.quota.hold_batch(owner, batch.id, batch.expires_at + QUOTA_GRACE_S, limits)
        static = batch.model_dump_json(include=set(_STATIC))
        kept_s = int(self.retention_s) + 2 * 86400  # longer than any record lives (window + retention)
        listed = names.batches_of(owner)
        try:
            await redis_client.in_steps(
                self.redis,
                lambda p: (p.zadd(listed, {batch.id: now}),
                           p.zremrangebyscore(listed, "-inf", now - kept_s), p.expire(listed, kept_s)),
                lambda p: p.hset(names.batch_record(batch.id), mapping={
                    "record": static, "status": "validating", **dict.fromkeys(COUNTERS, 0)}),
                lambda p: p.sadd(names.BATCHES_ACTIVE, batch.id))
        except BaseException:
            await redis_client.in_steps(self.redis, lambda p: p.delete(names.batch_record(batch.id)),
                                        lambda p: Quota.drop(p, owner, batch_field(batch.id)))
            raise
        return batch

    async def find(self, batch_id: str) -> Batch | None:
        fields = {k.decode(): v.decode() for k, v in
                  (await self.redis.hgetall(names.batch_record(batch_id))).items()}
        return _assemble(fields) if "record" in fields else None

    async def get(self, owner: str, batch_id: str) -> Batch:
        """The batch if `owner` made it; another key's batch is as absent as a missing one (404)."""
        batch = await self.find(batch_id)
        if batch is None or batch.owner != owner:
            raise NotFound(f"No batch found with id '{batch_id}'", param="batch_id",
                           code="batch_not_found")
        return batch

    async def list(self, owner: str, after: str | None = None, limit: int = 20) -> tuple[list[Batch], bool]:
        """One page of the owner's batches, newest first, and whether more follow. Read by rank
        from `after`'s place, never the whole list: it holds every batch the key made in the last
        32 days, and finished batches count against no quota (an id whose record expired is
        passed over). An `after` not in the list starts from the newest."""
        listed = names.batches_of(owner)
        rank = await self.redis.zrevrank(listed, after) if after is not None else None
        start, page = 0 if rank is None else rank + 1, []
        while len(page) <= limit:
            ids = await self.redis.zrange(listed, start, start + limit - len(page), desc=True)
            if not ids:
                break
            start += len(ids)
            page += [b for b in [await self.find(i.decode()) for i in ids] if b is not None]
        return page[:limit], len(page) > limit

    async def move(self, batch_id: str, to: Status, *sources: Status) -> tuple[bool, str | None]:
        """Set the status to `to` if it is one of `sources`: (moved, the status now)."""
        moved, status = await self._transition(keys=[names.batch_record(batch_id)],
                                               args=[to, int(time.time()), *sources])
        return moved == MOVED, status.decode() if isinstance(status, bytes) else status

    async def status(self, batch_id: str) -> str | None:
        raw = await self.redis.hget(names.batch_record(batch_id), "status")
        return raw.decode() if raw else None

    async def finish(self, batch: Batch, to: Status, *sources: Status) -> bool:
        """A final status: the batch leaves the active set and its owner's batches in progress,
        and its record expires with its files."""
        moved, _ = await self.move(batch.id, to, *sources)
        if moved:
            await self.retire(batch)
        return moved

    async def retire(self, batch: Batch) -> None:
        """What a batch in a final status no longer needs (again, if a runner died before). On a
        cluster the active set goes last: a retire cut short leaves the batch active, and
        `runnable` retires it again."""
        await redis_client.in_steps(
            self.redis, lambda p: Quota.drop(p, batch.owner, batch_field(batch.id)),
            lambda p: p.expire(names.batch_record(batch.id), int(self.retention_s)),
            lambda p: p.srem(names.BATCHES_ACTIVE, batch.id))

    async def runnable(self, batch_id: str) -> Batch | None:
        """The batch if it is still to run; an id whose record is gone or final (its runner died
        between the two steps of `finish`) leaves the active set here."""
        batch = await self.find(batch_id)
        if batch is None:
            await self.redis.srem(names.BATCHES_ACTIVE, batch_id)
        elif batch.status in FINAL:
            await self.retire(batch)
        return batch if batch is not None and batch.status not in FINAL else None

    async def update(self, batch_id: str, **fields) -> None:
        """Set plain fields (counters, model, result file ids, errors) of a batch."""
        mapping = {k: orjson.dumps(v) if k == "errors" else v for k, v in fields.items()
                   if v is not None}
        if mapping:
            await self.redis.hset(names.batch_record(batch_id), mapping=mapping)

    async def add(self, batch_id: str, **counts: int) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for counter, n in counts.items():
            pipe.hincrby(names.batch_record(batch_id), counter, n)
        await pipe.execute()

    async def active(self) -> list[str]:
        return sorted(i.decode() for i in await self.redis.smembers(names.BATCHES_ACTIVE))

    # -- runner leases: one runner per batch, a bounded number of batches at once ----------
    async def acquire(self, batch_id: str, lease_s: float, max_running: int) -> Acquired:
        now = time.time()
        return Acquired(await self._acquire(keys=[names.BATCHES_RUNNING],
                                            args=[batch_id, now, now + lease_s, max_running]))

    async def renew(self, batch_id: str, lease_s: float) -> None:
        await self.redis.zadd(names.BATCHES_RUNNING, {batch_id: time.time() + lease_s}, xx=True)

    async def release(self, batch_id: str) -> None:
        await self.redis.zrem(names.BATCHES_RUNNING, batch_id)

    async def running(self) -> set[str]:
        live = await self.redis.zrangebyscore(names.BATCHES_RUNNING, time.time(), "+inf")
        return {i.decode() for i in live}


def _assemble(fields: dict[str, str]) -> Batch:
    data = orjson.loads(fields["record"])
    data["status"] = fields["status"]
    for name in _TIMES:
        if name in fields:
            data[name] = int(fields[name])
    for name in ("output_file_id", "error_file_id", "model"):
        data[name] = fields.get(name) or None
    if fields.get("errors"):
        data["errors"] = {"object": "list", "data": orjson.loads(fields["errors"])}
    n = {c: int(fields.get(c, 0)) for c in COUNTERS}
    data["request_counts"] = {c: n[c] for c in ("total", "completed", "failed")}
    data["usage"] = {"input_tokens": n["prompt_tokens"], "output_tokens": n["completion_tokens"],
                     "total_tokens": n["prompt_tokens"] + n["completion_tokens"]}
    return Batch.model_validate(data)
