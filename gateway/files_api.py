"""/v1/files: upload (multipart, purpose=batch, JSONL), list, retrieve, content, delete.

A file belongs to the key that uploaded it (or whose batch produced it); to any other key it does
not exist (404). Sizes are checked against KVGATE_MAX_FILE_BYTES (413) and the number of lines
against KVGATE_MAX_FILE_LINES (400); the lines themselves are checked when a batch runs them. A
key's files count against its quotas of bytes and files (429, gateway/uploads.py streams the body
in against them), and every call here counts against its requests per minute.
"""
from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel

from gateway.admin_schemas import ErrorBody
from gateway.admission import set_ratelimit_headers
from gateway.auth import CurrentKey
from gateway.deps import FilesDep, LimitsDep, SettingsDep
from gateway.keys import KeyRecord
from gateway.list_page import ListPage
from gateway.uploads import ENVELOPE_BYTES, OPENAPI_BODY, receive_upload
from shared import names
from shared.errors import PermissionDenied
from shared.files import FileObject
from shared.quota import QuotaLimits
from shared.settings import GatewaySettings

UPLOAD_ENVELOPE_BYTES = ENVELOPE_BYTES  # room for the multipart framing around the file itself
ERRORS = {status: {"model": ErrorBody, "description": what} for status, what in (
    (400, "Not a batch file, not UTF-8, empty or too many lines"), (401, "No or a bad key"),
    (403, "A batch line's token"), (404, "No such file for this key"),
    (413, "File too large"), (429, "Requests per minute, or a stored-data quota, exceeded"))}
router = APIRouter(prefix="/v1/files", tags=["files"], responses=ERRORS)


async def account(request: Request, key: CurrentKey) -> KeyRecord:
    """Files and batches are managed with an API key; a batch line's token only sends requests."""
    if getattr(request.state, "lane", None) == names.BATCH_LANE:
        raise PermissionDenied("A batch line's token cannot manage files or batches",
                               code="batch_token_not_allowed")
    return key


Account = Annotated[KeyRecord, Depends(account)]


async def metered(request: Request, key: Account, limits: LimitsDep) -> KeyRecord:
    """`account`, counted against the key's requests per minute like every /v1 call that works."""
    set_ratelimit_headers(request, await limits.count_request(key))
    return key


Metered = Annotated[KeyRecord, Depends(metered)]


def quota_limits(s: GatewaySettings, key: KeyRecord) -> QuotaLimits:
    """The key's stored-data quotas: its own, else the gateway's defaults."""
    return QuotaLimits(key.name, _given(key.max_stored_bytes, s.max_stored_bytes_per_key),
                       _given(key.max_files, s.max_files_per_key),
                       _given(key.max_batches_in_progress, s.max_batches_in_progress_per_key))


def _given(value: int | None, default: int) -> int:
    return default if value is None else value


class FileList(ListPage[FileObject]):
    pass


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


@router.post("", response_model=FileObject, openapi_extra=OPENAPI_BODY)
async def upload(request: Request, key: Metered, store: FilesDep, settings: SettingsDep) -> FileObject:
    """Upload a batch input file: one request per line (`custom_id`, `method`, `url`, `body`).
    The key is checked before any of the body is read; the file is then streamed to disk."""
    record = await receive_upload(request, settings, store, key.id, quota_limits(settings, key))
    return record.public()


@router.get("", response_model=FileList)
async def list_files(key: Metered, store: FilesDep,
                     purpose: str | None = Query(None, description="batch or batch_output"),
                     limit: int = Query(10_000, ge=1, le=10_000),
                     after: str | None = Query(None, description="A file id: the page after it"),
                     order: Literal["asc", "desc"] = "desc") -> FileList:
    records, more = await store.list(key.id, purpose, order, after, limit)
    return FileList.of([r.public() for r in records], more)


@router.get("/{file_id}", response_model=FileObject)
async def retrieve(file_id: str, key: Metered, store: FilesDep) -> FileObject:
    return (await store.get(key.id, file_id)).public()


@router.get("/{file_id}/content", response_class=FileResponse,
            responses={200: {"content": {"application/jsonl": {}}, "description": "The file's bytes"}})
async def content(file_id: str, key: Metered, store: FilesDep) -> FileResponse:
    return FileResponse(store.content_path(await store.get(key.id, file_id)),
                        media_type="application/jsonl")


@router.delete("/{file_id}", response_model=FileDeleted)
async def delete(file_id: str, key: Metered, store: FilesDep) -> FileDeleted:
    await store.delete(await store.get(key.id, file_id))
    return FileDeleted(id=file_id)
