"""Files of /v1/files: the bytes under the data directory, the record (OpenAI's file object plus its
owner) in Redis. The gateway stores uploads; the batch runner reads inputs and stores results.

A file is written as it arrives (`NewFile`, chunk by chunk, never whole in memory) and published
by `FileStore.commit`, with its record and its entry in the owner's quota (shared/quota.py): one
transaction, or ordered per-slot steps on a cluster; deleting it removes all three. Every file has
an expiry; maintenance deletes expired ones (bytes and record), so neither the disk nor Redis grows
without bound.
"""
from __future__ import annotations

import codecs
import contextlib
import os
import re
import secrets
import time
from pathlib import Path
from typing import Literal

import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from shared import names, redis_client
from shared.errors import InvalidRequest, NotFound
from shared.quota import Quota, file_field

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


LIST_SCAN = 256  # ids a listing reads at a time while a purpose filters them
ABANDONED_S = 86400  # a partial file untouched this long belongs to no upload (they time out first)
BLANK = b" \t\r\n\f\v"  # a line of only these is blank: not a request, and not counted
_CONTENT = re.compile(rb"[^ \t\r\n\f\v][^\n]*")  # from a line's first non-blank byte to its end


class LineCheck:
    """A batch input file checked as its bytes arrive: UTF-8 (a character split across chunks is
    fine), its non-blank lines counted (lines end at b"\n", as the batch runner splits them) and
    measured (from a line's first non-blank byte: the runner parses each line whole, into ~30 times
    its size). 400 as soon as it is not UTF-8, has more than `max_lines` lines or one longer than
    `max_line_bytes`; `finish` says how many."""

    def __init__(self, max_lines: int, max_line_bytes: int | None = None, why_bytes: str = ""):
        self.max_lines, self.max_line_bytes, self.why_bytes = max_lines, max_line_bytes, why_bytes
        self.lines = 0
        self._open = 0  # bytes of the unfinished last line from its first non-blank (0: none yet)
        self._utf8 = codecs.getincrementaldecoder("utf-8")()

    def feed(self, chunk: bytes) -> None:
        try:
            self._utf8.decode(chunk)
        except UnicodeDecodeError:
            raise InvalidRequest("File must be UTF-8 JSONL", param="file", code="invalid_file") from None
        first = chunk.find(b"\n")
        head = len(chunk) if first < 0 else first
        found = ending = 0
        for start, end in (m.span() for m in _CONTENT.finditer(chunk)):
            if start < head and self._open:  # the line the previous chunk began goes on here
                size = self._open + end
            else:
                found += 1
                size = end - start
            self._measure(size, self.lines + found)
            ending = size if end == len(chunk) else 0
        if first < 0 and self._open:  # no line ends here: the open one goes on, blanks and all
            self._open += len(chunk)
            self._measure(self._open, self.lines)
        else:
            self._open = ending
        self.lines += found
        if self.lines > self.max_lines:
            raise InvalidRequest(f"File has at least {self.lines} lines; the limit is "
                                 f"{self.max_lines} lines (KVGATE_MAX_FILE_LINES)", param="file",
                                 code="too_many_lines")

    def _measure(self, size: int, line: int) -> None:
        if self.max_line_bytes is not None and size > self.max_line_bytes:
            raise InvalidRequest(f"Line {line} (not counting blank lines) exceeds the limit of "
                                 f"{self.max_line_bytes} bytes a line{self.why_bytes}", param="file",
                                 code="line_too_long")

    def finish(self) -> int:
        try:
            self._utf8.decode(b"", final=True)
        except UnicodeDecodeError:
            raise InvalidRequest("File must be UTF-8 JSONL", param="file", code="invalid_file") from None
        if self.lines == 0:
            raise InvalidRequest("File is empty", param="file", code="invalid_file")
        return self.lines


class NewFile:
    """A file being written: chunks go to a hidden file beside where it will live (synchronous
    writes: call from a thread), until `FileStore.commit` publishes it or `discard` removes it."""

    def __init__(self, directory: Path, owner: str, purpose: Purpose, filename: str = "input.jsonl"):
        self.id = new_file_id()
        self.owner, self.purpose, self.filename = owner, purpose, filename
        self.tmp = directory / f".{self.id}.tmp"
        self.size = 0
        self._out = None

    def write(self, data: bytes) -> None:
        if self._out is None:
            self.tmp.parent.mkdir(parents=True, exist_ok=True)
            self._out = open(self.tmp, "wb")
        self._out.write(data)
        self.size += len(data)

    def close(self) -> None:
        if self._out is None:
            self.write(b"")  # an empty file is still a file
        self._out.close()

    def discard(self) -> None:
        if self._out is not None:
            self._out.close()
        self.tmp.unlink(missing_ok=True)


class FileStore:
    def __init__(self, redis: aioredis.Redis, data_dir: Path, retention_s: float):
        self.redis = redis
        self.dir = Path(data_dir) / "files"
        self.retention_s = retention_s
        self.quota = Quota(redis)

    def path(self, file_id: str) -> Path:
        return self.dir / file_id

    def begin(self, owner: str, purpose: Purpose, filename: str = "input.jsonl") -> NewFile:
        return NewFile(self.dir, owner, purpose, filename)

    async def commit(self, new: NewFile, upload: str | None = None) -> StoredFile:
        """Bytes first (renamed into place), then the record that points at them, the indexes, and
        the file's entry in its owner's quota (which replaces the upload's hold, if any): one
        transaction on one Redis; on a cluster three slots, in this order: the expiry index (the
        sweeper drops an id without a record, and its bytes), the record, then the owner's list and
        quota (one slot, `{k:}`). A failure between leaves a file nobody lists or counts, swept at
        its expiry; never a quota that counts a file without a record."""
        now = time.time()
        record = StoredFile(id=new.id, bytes=new.size, created_at=int(now),
                            expires_at=int(now + self.retention_s), filename=new.filename,
                            purpose=new.purpose, owner=new.owner)
        new.close()
        os.replace(new.tmp, self.path(record.id))
        try:
            await redis_client.in_steps(
                self.redis,
                lambda p: p.zadd(names.FILES_EXPIRY, {record.id: record.expires_at}),
                lambda p: p.set(names.file_record(record.id), record.model_dump_json()),
                lambda p: (p.zadd(names.files_of(record.owner), {record.id: now}),
                           Quota.store_file(p, record.owner, record.id, record.bytes, upload)))
        except BaseException:
            self.path(record.id).unlink(missing_ok=True)
            raise
        return record

    async def create(self, owner: str, filename: str, purpose: Purpose, content: bytes) -> StoredFile:
        """A small file from bytes in hand (tests, tools); uploads and batch results stream."""
        new = self.begin(owner, purpose, filename)
        new.write(content)
        return await self.commit(new)

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
        follow. Read by rank from `after`'s place, as many as the page needs (LIST_SCAN at a time
        while a purpose filters them), never the whole list at once: a key may keep up to 100,000
        files. An `after` not in the list starts from the first."""
        listed, desc = names.files_of(owner), order == "desc"
        rank = None
        if after is not None:
            rank = await (self.redis.zrevrank if desc else self.redis.zrank)(listed, after)
        start, records = 0 if rank is None else rank + 1, []
        while len(records) <= limit:
            wanted = LIST_SCAN if purpose is not None else limit + 1 - len(records)
            ids = await self.redis.zrange(listed, start, start + wanted - 1, desc=desc)
            if not ids:
                break
            start += len(ids)
            for raw in await redis_client.mget(self.redis, [names.file_record(i.decode()) for i in ids]):
                if raw is not None:
                    record = StoredFile.model_validate_json(raw)
                    if purpose is None or record.purpose == purpose:
                        records.append(record)
        return records[:limit], len(records) > limit

    async def delete(self, record: StoredFile) -> None:
        """Record, indexes and quota entry in one transaction (a second delete changes nothing),
        then the bytes. On a cluster, the reverse of `commit`: the owner's list and quota first,
        then the record, then the expiry index; a failure between leaves a record nobody lists or
        counts, which a second delete or the sweeper removes."""
        await redis_client.in_steps(
            self.redis,
            lambda p: (p.zrem(names.files_of(record.owner), record.id),
                       Quota.drop(p, record.owner, file_field(record.id))),
            lambda p: p.delete(names.file_record(record.id)),
            lambda p: p.zrem(names.FILES_EXPIRY, record.id))
        self.path(record.id).unlink(missing_ok=True)

    async def expire(self, now: float | None = None) -> int:
        """Delete every file past its expiry, and what uploads cut short by a dead process left on
        disk; how many files went."""
        now = now or time.time()
        for partial in self.dir.glob(".*.tmp") if self.dir.exists() else []:
            with contextlib.suppress(FileNotFoundError):  # its upload may just have finished
                if partial.stat().st_mtime < now - ABANDONED_S:
                    partial.unlink()
        due = await self.redis.zrangebyscore(names.FILES_EXPIRY, "-inf", now)
        for file_id in (i.decode() for i in due):
            record = await self.find(file_id)
            if record is None:  # its record is gone already: only its index entry and bytes left
                await self.redis.zrem(names.FILES_EXPIRY, file_id)
                self.path(file_id).unlink(missing_ok=True)
            else:
                await self.delete(record)
        return len(due)
