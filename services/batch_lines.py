"""A batch's input file, line by line: each line is checked for what the gateway cannot check (the
batch's envelope), and only where it lies is kept; its body is read back when it is sent."""
from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import orjson

from shared.files import BLANK
from shared.names import MODEL_NAME_CHARS


@dataclass
class Line:
    """One input line: where it is and what it asks for, or why it cannot be sent."""

    number: int  # 1-based, in the input file
    custom_id: str | None = None
    model: str | None = None
    span: tuple[int, int] | None = None  # (offset, length) in the input file, when it can be sent
    error: tuple[str, str] | None = None  # (code, message)


def parse_lines(data: bytes | str, endpoint: str) -> list[Line]:
    """Every non-blank line, checked for what the gateway cannot check: the batch's envelope
    (`custom_id` unique, `method` POST, `url` the batch's endpoint, `body` with a `model` of at most
    MODEL_NAME_CHARS, no `stream`). The body's own fields are checked by the gateway when the line
    is sent. Lines end at "\n" and blanks are ASCII whitespace, as the gateway counted them at upload."""
    return list(_parse(io.BytesIO(data.encode() if isinstance(data, str) else data), endpoint))


def _parse(f: BinaryIO, endpoint: str):
    """The lines of a file, one at a time (a line that is not UTF-8 raises UnicodeDecodeError)."""
    seen: set[str] = set()
    offset = 0
    for number, raw in enumerate(f, 1):
        raw.decode("utf-8")
        if raw.strip(BLANK):
            yield _check(number, raw, offset, endpoint, seen)
        offset += len(raw)


def _check(number: int, raw: bytes, offset: int, endpoint: str, seen: set[str]) -> Line:
    line = Line(number)
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        line.error = ("invalid_json", f"Line {number} is not valid JSON: {exc}")
        return line
    if not isinstance(obj, dict):
        line.error = ("invalid_request", f"Line {number} is not a JSON object")
        return line
    cid = obj.get("custom_id")
    line.custom_id = cid if isinstance(cid, str) and cid else None
    body = obj.get("body")
    why = None
    if line.custom_id is None:
        why = ("missing_custom_id", "custom_id must be a non-empty string")
    elif cid in seen:
        why = ("duplicate_custom_id", f"custom_id '{cid}' is used by an earlier line")
    elif obj.get("method") != "POST":
        why = ("invalid_method", f"method must be 'POST', not {obj.get('method')!r}")
    elif obj.get("url") != endpoint:
        why = ("mismatched_endpoint", f"url {obj.get('url')!r} is not the batch's endpoint '{endpoint}'")
    elif not isinstance(body, dict):
        why = ("invalid_body", "body must be a JSON object")
    elif not isinstance(body.get("model"), str):
        why = ("missing_model", "body.model must be a string")
    elif len(body["model"]) > MODEL_NAME_CHARS:  # it names the batch's model and a Redis key
        why = ("invalid_model", f"body.model is longer than {MODEL_NAME_CHARS} characters")
    elif body.get("stream"):
        why = ("invalid_request", "stream is not supported in a batch")
    if why is not None:
        line.error = (why[0], f"Line {number}: {why[1]}")
    else:
        line.model, line.span = body["model"], (offset, len(raw))
    if line.custom_id is not None:
        seen.add(line.custom_id)
    return line


class Input:
    """A batch's input file, held open while the batch runs (deleting the file meanwhile does not
    pull it away). Its lines are checked in one pass that keeps only where each is; a line's body
    is read back when it is sent, so the requests are never all in memory at once."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_RDONLY)

    def lines(self, endpoint: str) -> list[Line]:
        with open(self.fd, "rb", closefd=False) as f:
            return list(_parse(f, endpoint))

    def body(self, line: Line) -> dict:
        offset, length = line.span
        return orjson.loads(os.pread(self.fd, length, offset))["body"]

    def close(self) -> None:
        os.close(self.fd)
