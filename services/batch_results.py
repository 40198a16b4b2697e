"""A batch's results: one record per input line in OpenAI's output-file shape, appended to a
progress file as they come, and indexed by where each record lies, so the output and error files
and the batch's counts are made from that one record without holding it in memory."""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import orjson

from services.batch_lines import Line


def result(line: Line, *, status: int | None = None, request_id: str | None = None,
           body: dict | None = None, error: tuple[str, str] | None = None) -> dict:
    """One line of the output or error file, in OpenAI's shape: an HTTP answer in `response`, a
    failure that had none in `error`."""
    response = None if status is None else {"status_code": status, "request_id": request_id,
                                            "body": body}
    return {"id": "batch_req_" + secrets.token_hex(12), "custom_id": line.custom_id,
            "response": response,
            "error": None if error is None else {"code": error[0], "message": error[1]}}


def succeeded(record: dict) -> bool:
    return record["response"] is not None and record["response"]["status_code"] == 200


@dataclass(frozen=True)
class Entry:
    """Where one line's result lies in the progress file, and what it counts for."""

    offset: int
    length: int
    ok: bool
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def of(cls, record: dict, offset: int = 0, length: int = 0) -> "Entry":
        usage = usage_of(record) if succeeded(record) else {}
        return cls(offset, length, succeeded(record), usage.get("prompt_tokens", 0),
                   usage.get("completion_tokens", 0))


class Progress:
    """The results so far, one JSON line per input line, appended as they come."""

    def __init__(self, path: Path):
        self.path = path
        self.bytes = path.stat().st_size if path.exists() else 0  # what the results take so far

    def index(self) -> dict[int, Entry]:
        """Line number -> its entry, read one record at a time."""
        out: dict[int, Entry] = {}
        if not self.path.exists():
            return out
        offset = 0
        with open(self.path, "rb") as f:
            for raw in f:
                try:
                    entry = orjson.loads(raw)
                    out[entry["line"]] = Entry.of(entry["result"], offset, len(raw))
                except orjson.JSONDecodeError:  # a line cut short by a crash
                    pass
                offset += len(raw)
        if offset and not raw.endswith(b"\n"):  # the cut line must not swallow the next one
            with open(self.path, "ab") as f:
                f.write(b"\n")
        return out

    @staticmethod
    def read(f: BinaryIO, entry: Entry) -> dict:
        f.seek(entry.offset)
        return orjson.loads(f.read(entry.length))["result"]

    def append(self, number: int, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        raw = orjson.dumps({"line": number, "result": record}) + b"\n"
        with open(self.path, "ab") as f:
            f.write(raw)
        self.bytes += len(raw)


def usage_of(record: dict) -> dict:
    body = (record["response"] or {}).get("body")
    return (body.get("usage") or {}) if isinstance(body, dict) else {}


def tally(entries) -> dict[str, int]:
    """The batch's counters, from the entries of its results."""
    entries = list(entries)
    ok = [e for e in entries if e.ok]
    return {"completed": len(ok), "failed": len(entries) - len(ok),
            "prompt_tokens": sum(e.prompt_tokens for e in ok),
            "completion_tokens": sum(e.completion_tokens for e in ok)}
