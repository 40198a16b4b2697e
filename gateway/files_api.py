"""/v1/files: upload (multipart, purpose=batch, JSONL), list, retrieve, content, delete.

A file belongs to the key that uploaded it (or whose batch produced it); to any other key it does
not exist (404). Sizes are checked against KVGATE_MAX_FILE_BYTES (413) and the number of lines
against KVGATE_MAX_FILE_LINES (400); the lines themselves are checked when a batch runs them.
"""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse
from pydantic import BaseModel

from gateway.admin_schemas import ErrorBody
from gateway.auth import authenticate
from gateway.keys import KeyRecord
from gateway.list_page import ListPage
from shared import names
from shared.errors import InvalidRequest, PayloadTooLarge, PermissionDenied
from shared.files import FileObject, FileStore

UPLOAD_ENVELOPE_BYTES = 64 << 10  # room for the multipart framing around the file itself
ERRORS = {status: {"model": ErrorBody, "description": what} for status, what in (
    (400, "Not a batch file, not UTF-8, empty or too many lines"), (401, "No or a bad key"),
    (403, "A batch line's token"), (404, "No such file for this key"),
    (413, "File too large"))}
router = APIRouter(prefix="/v1/files", tags=["files"], responses=ERRORS)


async def account(request: Request, key: KeyRecord = Depends(authenticate)) -> KeyRecord:
    """Files and batches are managed with an API key; a batch line's token only sends requests."""
    if getattr(request.state, "lane", None) == names.BATCH_LANE:
        raise PermissionDenied("A batch line's token cannot manage files or batches",
                               code="batch_token_not_allowed")
    return key


class FileList(ListPage[FileObject]):
    pass


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


def _store(request: Request) -> FileStore:
    return request.app.state.files


@router.post("", response_model=FileObject)
async def upload(request: Request, file: UploadFile = File(description="A JSONL file of requests"),
                 purpose: str = Form(description="Only 'batch' is accepted"),
                 key: KeyRecord = Depends(account)) -> FileObject:
    """Upload a batch input file: one request per line (`custom_id`, `method`, `url`, `body`)."""
    settings = request.app.state.settings
    if purpose != "batch":
        raise InvalidRequest(f"purpose '{purpose}' is not supported; use 'batch'", param="purpose")
    content = await file.read(settings.max_file_bytes + 1)
    if len(content) > settings.max_file_bytes:
        raise PayloadTooLarge(f"File exceeds the limit of {settings.max_file_bytes} bytes "
                              "(KVGATE_MAX_FILE_BYTES)", param="file", code="file_too_large")
    lines = _count_lines(content)
    if lines > settings.max_file_lines:
        raise InvalidRequest(f"File has {lines} lines; the limit is {settings.max_file_lines} "
                             "lines (KVGATE_MAX_FILE_LINES)", param="file", code="too_many_lines")
    record = await _store(request).create(key.id, file.filename or "input.jsonl", "batch", content)
    return record.public()


def _count_lines(content: bytes) -> int:
    """Non-blank lines of a UTF-8 file; 400 for anything else or for none."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("File must be UTF-8 JSONL", param="file", code="invalid_file") from None
    lines = sum(1 for line in text.splitlines() if line.strip())
    if lines == 0:
        raise InvalidRequest("File is empty", param="file", code="invalid_file")
    return lines


@router.get("", response_model=FileList)
async def list_files(request: Request, key: KeyRecord = Depends(account),
                     purpose: str | None = Query(None, description="batch or batch_output"),
                     limit: int = Query(10_000, ge=1, le=10_000),
                     after: str | None = Query(None, description="A file id: the page after it"),
                     order: Literal["asc", "desc"] = "desc") -> FileList:
    records, more = await _store(request).list(key.id, purpose, order, after, limit)
    return FileList.of([r.public() for r in records], more)


@router.get("/{file_id}", response_model=FileObject)
async def retrieve(file_id: str, request: Request, key: KeyRecord = Depends(account)) -> FileObject:
    return (await _store(request).get(key.id, file_id)).public()


@router.get("/{file_id}/content", response_class=FileResponse,
            responses={200: {"content": {"application/jsonl": {}}, "description": "The file's bytes"}})
async def content(file_id: str, request: Request, key: KeyRecord = Depends(account)) -> FileResponse:
    store = _store(request)
    return FileResponse(store.content_path(await store.get(key.id, file_id)),
                        media_type="application/jsonl")


@router.delete("/{file_id}", response_model=FileDeleted)
async def delete(file_id: str, request: Request, key: KeyRecord = Depends(account)) -> FileDeleted:
    store = _store(request)
    await store.delete(await store.get(key.id, file_id))
    return FileDeleted(id=file_id)
