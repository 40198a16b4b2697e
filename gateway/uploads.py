"""How POST /v1/files takes a file: only once its key is known (an upload without a valid key is
refused before a byte of its body is read), and as a stream. The multipart body is parsed chunk by
chunk as it arrives; the `file` part goes to disk as it comes, checked on the way (size, UTF-8,
lines), and held against the key's stored-data quota as it grows. Parsing, checking and writing run
in a thread, so the event loop only passes chunks on; no step holds more than one chunk.
"""
from __future__ import annotations

import asyncio
import secrets
import time

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from shared.errors import InvalidRequest, PayloadTooLarge, QuotaExceeded, RequestTimeout
from shared.files import FileStore, LineCheck, NewFile, StoredFile
from shared.quota import Quota, QuotaLimits, upload_field
from shared.settings import GatewaySettings

ENVELOPE_BYTES = 64 << 10  # the most of a body that is not the file: framing and other fields
FIELD_BYTES = 1024  # the most a form field other than the file (purpose, ...) may hold
HOLD_STEP = 4 << 20  # an upload's quota hold grows ahead of its bytes by this much
ESCAPED = 6  # bytes a line may spend on one byte of its body: a character written as \uXXXX

OPENAPI_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {
        "file": {"type": "string", "format": "binary", "contentMediaType": "application/octet-stream",
                 "description": "A JSONL file of requests"},
        "purpose": {"type": "string", "enum": ["batch"], "description": "Only 'batch' is accepted"},
    }}}}}}  # what the route reads itself, documented as FastAPI would for File() and Form()


class UploadForm:
    """One multipart/form-data body: the `file` part is written to `sink` (through `check`), the
    other fields are kept; `purpose` is checked as soon as it has arrived."""

    def __init__(self, content_type: str | None, sink: NewFile, check: LineCheck, max_file_bytes: int):
        mime, params = parse_options_header(content_type)
        if mime != b"multipart/form-data" or not params.get(b"boundary"):
            raise InvalidRequest("Upload a file as multipart/form-data with fields 'file' and "
                                 "'purpose'", code="invalid_multipart")
        self.sink, self.check, self.max_file_bytes = sink, check, max_file_bytes
        self.fields: dict[str, str] = {}
        self.body_bytes = 0
        self._has_file = self._ended = False
        self._part: _Part | None = None
        try:
            self._parser = MultipartParser(params[b"boundary"], callbacks={
                "on_part_begin": self._begin, "on_header_field": self._header_field,
                "on_header_value": self._header_value, "on_header_end": self._header_end,
                "on_headers_finished": self._headers_done, "on_part_data": self._data,
                "on_part_end": self._end, "on_end": self._form_end})
        except FormParserError as exc:
            raise _malformed(exc) from None

    def feed(self, chunk: bytes) -> None:
        """Parse, check and write one chunk of the body (blocking: run it in a thread)."""
        self.body_bytes += len(chunk)
        try:
            self._parser.write(chunk)
        except FormParserError as exc:
            raise _malformed(exc) from None
        if self.body_bytes - self.sink.size > ENVELOPE_BYTES:
            raise InvalidRequest(f"The form around the file exceeds {ENVELOPE_BYTES} bytes",
                                 code="invalid_multipart")

    def finish(self) -> str:
        """The whole body has come: the form must be complete; the file's name."""
        try:
            self._parser.finalize()
        except FormParserError as exc:
            raise _malformed(exc) from None
        if not self._ended:
            raise _malformed("the body ended before the form's closing boundary")
        if not self._has_file:
            raise InvalidRequest("The form has no 'file'", param="file", code="invalid_multipart")
        if "purpose" not in self.fields:
            raise InvalidRequest("The form has no 'purpose'; use 'batch'", param="purpose")
        self.check.finish()
        self.sink.close()
        return self.sink.filename

    # -- python-multipart's callbacks -------------------------------------------------------
    def _begin(self) -> None:
        self._part = _Part()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._part.header_name += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._part.header_value += data[start:end]

    def _header_end(self) -> None:
        if self._part.header_name.lower() == b"content-disposition":
            self._part.disposition = self._part.header_value
        self._part.header_name, self._part.header_value = b"", b""

    def _headers_done(self) -> None:
        _, options = parse_options_header(self._part.disposition)
        self._part.name = options.get(b"name", b"").decode("utf-8", "replace")
        if self._part.name == "file":
            if self._has_file:
                raise InvalidRequest("The form has more than one 'file'", param="file",
                                     code="invalid_multipart")
            self._has_file = self._part.is_file = True
            filename = options.get(b"filename", b"").decode("utf-8", "replace")
            self.sink.filename = filename[:255] or "input.jsonl"

    def _data(self, data: bytes, start: int, end: int) -> None:
        if not self._part.is_file:
            self._part.value += data[start:end]
            if len(self._part.value) > FIELD_BYTES:
                raise InvalidRequest(f"Form field '{self._part.name}' exceeds {FIELD_BYTES} bytes",
                                     param=self._part.name or None, code="invalid_multipart")
            return
        if self.sink.size + (end - start) > self.max_file_bytes:
            raise PayloadTooLarge(f"File exceeds the limit of {self.max_file_bytes} bytes "
                                  "(KVGATE_MAX_FILE_BYTES)", param="file", code="file_too_large")
        piece = data[start:end]
        self.check.feed(piece)
        self.sink.write(piece)

    def _form_end(self) -> None:
        self._ended = True

    def _end(self) -> None:
        if self._part.is_file:
            return
        value = self._part.value.decode("utf-8", "replace")
        self.fields[self._part.name] = value
        if self._part.name == "purpose" and value != "batch":
            raise InvalidRequest(f"purpose '{value[:64]}' is not supported; use 'batch'",
                                 param="purpose")


class _Part:
    def __init__(self):
        self.header_name = self.header_value = self.disposition = b""
        self.name = ""
        self.is_file = False
        self.value = bytearray()


def _malformed(exc: Exception | str) -> InvalidRequest:
    return InvalidRequest(f"The body is not valid multipart/form-data: {exc}", code="invalid_multipart")


class UploadHold:
    """The share of the key's stored-bytes quota an upload in progress holds: at least the bytes
    already written, grown a step ahead; it becomes the file's own entry when the file is stored,
    and goes when the upload fails. A refusal means the bytes already come do not fit."""

    def __init__(self, quota: Quota, owner: str, limits: QuotaLimits, max_file_bytes: int,
                 ttl_s: float):
        self.quota, self.owner, self.limits = quota, owner, limits
        self.max_file_bytes, self.ttl_s = max_file_bytes, ttl_s
        self.token = secrets.token_hex(8)
        self.held = -1
        self._tight = False  # a step ahead was refused: from now on hold only what has come

    async def cover(self, nbytes: int) -> None:
        if nbytes <= self.held:
            return
        ahead = min(nbytes + HOLD_STEP, self.max_file_bytes)
        if not self._tight and ahead > nbytes:
            try:
                return await self._hold(ahead)
            except QuotaExceeded:
                self._tight = True
        await self._hold(nbytes)

    async def release(self) -> None:
        await self.quota.release(self.owner, upload_field(self.token))

    async def _hold(self, nbytes: int) -> None:
        await self.quota.hold_upload(self.owner, self.token, nbytes, time.time() + self.ttl_s,
                                     self.limits)
        self.held = nbytes


async def receive_upload(request: Request, settings: GatewaySettings, store: FileStore, owner: str,
                         limits: QuotaLimits) -> StoredFile:
    """The uploaded file, stored and counted; on any failure nothing of it is left (partial bytes
    removed, quota hold released)."""
    new = store.begin(owner, "batch")
    hold = UploadHold(store.quota, owner, limits, settings.max_file_bytes,
                      settings.request_timeout_s + 60)
    try:
        form = UploadForm(request.headers.get("content-type"), new,
                          _line_check(settings), settings.max_file_bytes)
        await hold.cover(_least_file_bytes(request))  # refused here: nothing of the body read
        async with asyncio.timeout(settings.request_timeout_s):
            async for chunk in request.stream():
                await asyncio.to_thread(form.feed, chunk)
                await hold.cover(new.size)
            await asyncio.to_thread(form.finish)
        return await store.commit(new, hold.token)
    except BaseException as exc:
        await asyncio.to_thread(new.discard)
        await asyncio.shield(hold.release())
        raise _why(exc, settings.request_timeout_s) from None


def _line_check(settings: GatewaySettings) -> LineCheck:
    """Lines no longer than a request body the gateway takes, even if every character of it is
    JSON-escaped: a longer one could only be refused (413) after the runner had parsed it."""
    return LineCheck(settings.max_file_lines, ESCAPED * settings.max_body_bytes,
                     f" ({ESCAPED} x KVGATE_MAX_BODY_BYTES, the largest request body, escaped)")


def _least_file_bytes(request: Request) -> int:
    """The fewest bytes the file can have, from the body's declared length (0 if none)."""
    length = request.headers.get("content-length", "")
    return max(0, int(length) - ENVELOPE_BYTES) if length.isdigit() and len(length) < 19 else 0


def _why(exc: BaseException, timeout_s: float) -> BaseException:
    """A client that left or stalled, said as an error of ours (it is logged, not a crash)."""
    if isinstance(exc, ClientDisconnect):
        return InvalidRequest("The client closed the connection during the upload",
                              code="client_disconnected")
    if isinstance(exc, TimeoutError):
        return RequestTimeout(f"The upload did not finish within {timeout_s:g} s "
                              "(KVGATE_REQUEST_TIMEOUT_S)", code="upload_timeout")
    return exc
