"""Files of /v1/files: the bytes under the data directory, the record (OpenAI's file object plus its
owner) in Redis. The gateway stores uploads; the batch runner reads inputs and stores results.

Every file has an expiry; maintenance deletes expired ones (bytes and record), so neither the disk
nor Redis grows without bound.
"""
from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Literal

import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from shared import names
from shared.errors import NotFound

Purpose = Literal["batch", "batch_output"]


class FileObject(BaseModel):
    """OpenAI's file object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int = Field(description="Unix time")
    expires_at: int | None = Field(None, description="Unix time the file is deleted")
    filename: str
    purpose: Purpose
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: str | None = None


class StoredFile(FileObject):
    owner: str  # the key id that uploaded it (or whose batch made it)

    def public(self) -> FileObject:
        return FileObject.model_validate(self.model_dump(exclude={"owner"}))


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


class FileStore:
    def __init__(self, redis: aioredis.Redis, data_dir: Path, retention_s: float):
        self.redis = redis
        self.dir = Path(data_dir) / "files"
        self.retention_s = retention_s

    def path(self, file_id: str) -> Path:
        return self.dir / file_id

    async def create(self, owner: str, filename: str, purpose: Purpose, content: bytes) -> StoredFile:
        """Bytes first (written whole, then renamed into place), then the record that points at them."""
        now = time.time()
        record = StoredFile(id=new_file_id(), bytes=len(content), created_at=int(now),
                            expires_at=int(now + self.retention_s), filename=filename,
                            purpose=purpose, owner=owner)
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{record.id}.tmp"
        tmp.write_bytes(content)
        os.replace(tmp, self.path(record.id))
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(names.file_record(record.id), record.model_dump_json())
        pipe.zadd(names.files_of(owner), {record.id: now})
        pipe.zadd(names.FILES_EXPIRY, {record.id: record.expires_at})
        await pipe.execute()
        return record

    async def find(self, file_id: str) -> StoredFile | None:
        raw = await self.redis.get(names.file_record(file_id))
        return StoredFile.model_validate_json(raw) if raw else None

    async def get(self, owner: str, file_id: str, param: str = "file_id") -> StoredFile:
        """The file if `owner` has it; another key's file is as absent as a missing one (404)."""
        record = await self.find(file_id)
        if record is None or record.owner != owner:
            raise NotFound(f"No such File object: {file_id}", param=param, code="file_not_found")
        return record

    def content_path(self, record: StoredFile) -> Path:
        """Where the file's bytes are; 404 if they are gone (deleted under the record's feet)."""
        path = self.path(record.id)
        if not path.exists():
            raise NotFound(f"The content of file {record.id} is gone", code="file_not_found")
        return path

    async def list(self, owner: str, purpose: str | None = None, order: str = "desc",
                   after: str | None = None, limit: int = 100) -> tuple[list[StoredFile], bool]:
        """One page of the owner's files, newest first (or oldest with order=asc), and whether more
        follow."""
        ids = [i.decode() for i in await self.redis.zrange(names.files_of(owner), 0, -1,
                                                           desc=order == "desc")]
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1:]
        records = []
        for raw in await self.redis.mget([names.file_record(i) for i in ids]) if ids else []:
            if raw is not None:
                record = StoredFile.model_validate_json(raw)
                if purpose is None or record.purpose == purpose:
                    records.append(record)
        return records[:limit], len(records) > limit

    async def delete(self, record: StoredFile) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(names.file_record(record.id))
        pipe.zrem(names.files_of(record.owner), record.id)
        pipe.zrem(names.FILES_EXPIRY, record.id)
        await pipe.execute()
        self.path(record.id).unlink(missing_ok=True)

    async def expire(self, now: float | None = None) -> int:
        """Delete every file past its expiry; how many went."""
        due = await self.redis.zrangebyscore(names.FILES_EXPIRY, "-inf", now or time.time())
        for file_id in (i.decode() for i in due):
            record = await self.find(file_id)
            if record is None:
                await self.redis.zrem(names.FILES_EXPIRY, file_id)
            else:
                await self.delete(record)
        return len(due)
