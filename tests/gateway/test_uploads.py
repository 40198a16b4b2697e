"""The upload form parsed as it arrives: whatever the chunking, the file on disk and its line count
are the same, the limits bite as soon as they are crossed, and a bad form is a 400 naming why."""
from __future__ import annotations

import pytest

from gateway.uploads import UploadForm
from shared.errors import InvalidRequest, PayloadTooLarge
from shared.files import LineCheck, NewFile

BOUNDARY = "kvgate-test-boundary"
CONTENT_TYPE = f"multipart/form-data; boundary={BOUNDARY}"


def form(*parts: tuple[str, bytes, str | None]) -> bytes:
    """A multipart body of (name, value, filename) parts."""
    out = b""
    for name, value, filename in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += (f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n"
                "Content-Type: application/octet-stream\r\n\r\n").encode() + value + b"\r\n"
    return out + f"--{BOUNDARY}--\r\n".encode()


def parse(tmp_path, body: bytes, chunk: int, max_bytes: int = 1 << 20, max_lines: int = 100):
    sink = NewFile(tmp_path, "key_t", "batch")
    parsed = UploadForm(CONTENT_TYPE, sink, LineCheck(max_lines), max_bytes)
    try:
        for i in range(0, len(body), chunk):
            parsed.feed(body[i:i + chunk])
        filename = parsed.finish()
    except Exception:
        sink.discard()
        raise
    return filename, sink.tmp.read_bytes(), parsed.check.lines, sink


JSONL = ('{"custom_id": "a"}\n\n   \n{"custom_id": "é€😀"}\r\n{"custom_id": "c"}  \n'
         '\t\n{"custom_id": "d"}').encode()


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 10_000])
def test_any_chunking_gives_the_same_file_and_count(tmp_path, chunk):
    body = form(("purpose", b"batch", None), ("file", JSONL, "in.jsonl"))
    filename, written, lines, _ = parse(tmp_path, body, chunk)
    assert (filename, written, lines) == ("in.jsonl", JSONL, 4)


def test_the_count_is_the_batch_runners(tmp_path):
    from services.batch_lines import parse_lines

    text = JSONL.decode()
    assert len(parse_lines(text, "/v1/chat/completions")) == 4
    odd = "a\u2028b\n\u00a0\n".encode()  # splitlines() would see 4 lines here; "\n" ends 2
    sink = NewFile(tmp_path, "k", "batch")
    check = LineCheck(10)
    check.feed(odd)
    assert check.finish() == len(parse_lines(odd.decode(), "/v1/chat/completions")) == 2
    sink.discard()


@pytest.mark.parametrize("chunk", [1, 2, 5, 64, 10_000])
def test_a_line_longer_than_its_bound_is_refused_whatever_the_chunking(chunk):
    # measured from its first non-blank byte, as the runner's parse costs; blank lines are free
    def check(text: bytes) -> int:
        lines = LineCheck(100, max_line_bytes=10)
        for i in range(0, len(text), chunk):
            lines.feed(text[i:i + chunk])
        return lines.finish()

    assert check(b"0123456789\n  \t012345678 \n\n" + b" " * 50 + b"\n{}\n0123456789") == 4
    for long in (b"0123456789a\n{}\n", b"{}\n   0123456789a", b"{}\n\n0123456789a\r\n{}"):
        with pytest.raises(InvalidRequest) as refused:
            check(long)
        assert refused.value.code == "line_too_long" and "10 bytes" in str(refused.value)


def test_file_first_then_purpose_and_a_filename_is_kept(tmp_path):
    body = form(("file", b"{}\n", "x.jsonl"), ("purpose", b"batch", None))
    assert parse(tmp_path, body, 5)[:3] == ("x.jsonl", b"{}\n", 1)


def test_a_wrong_purpose_is_refused_before_the_file_is_read(tmp_path):
    body = form(("purpose", b"fine-tune", None), ("file", b"{}\n" * 1000, "x.jsonl"))
    sink = NewFile(tmp_path, "k", "batch")
    parsed = UploadForm(CONTENT_TYPE, sink, LineCheck(10_000), 1 << 20)
    head = body.index(b'name="file"')
    with pytest.raises(InvalidRequest, match="purpose 'fine-tune'"):
        parsed.feed(body[:head])
    assert sink.size == 0


def test_too_large_is_413_as_soon_as_the_limit_is_crossed(tmp_path):
    body = form(("purpose", b"batch", None), ("file", b"{}\n" * 100, "x.jsonl"))
    sink = NewFile(tmp_path, "k", "batch")
    parsed = UploadForm(CONTENT_TYPE, sink, LineCheck(10_000), 150)
    with pytest.raises(PayloadTooLarge, match="150 bytes"):
        for i in range(0, len(body), 16):
            parsed.feed(body[i:i + 16])
    assert sink.size <= 150  # nothing past the limit reached the disk
    sink.discard()
    assert not sink.tmp.exists()


@pytest.mark.parametrize("body, why", [
    (form(("purpose", b"batch", None), ("file", b"\xff\xfe{}\n", "x")), "UTF-8"),
    (form(("purpose", b"batch", None), ("file", b"{}\n\xe2\x82", "x")), "UTF-8"),  # cut character
    (form(("purpose", b"batch", None), ("file", b"\n  \n", "x")), "empty"),
    (form(("purpose", b"batch", None), ("file", b"{}\n" * 11, "x")), "at least 11 lines"),
    (form(("purpose", b"batch", None)), "no 'file'"),
    (form(("file", b"{}\n", "x")), "no 'purpose'"),
    (form(("purpose", b"batch", None), ("file", b"{}\n", "x"), ("file", b"{}\n", "y")), "more than one"),
    (form(("purpose", b"b" * 2000, None)), "exceeds 1024 bytes"),
    (form(("purpose", b"batch", None), ("file", b"{}\n", "x"))[:-10], "not valid multipart"),
    (b"not a form at all", "not valid multipart"),
])
def test_a_bad_form_is_400_naming_why(tmp_path, body, why):
    with pytest.raises(InvalidRequest, match=why):
        parse(tmp_path, body, 7, max_lines=10)


def test_only_multipart_is_taken(tmp_path):
    for content_type in (None, "application/json", "multipart/form-data"):  # the last: no boundary
        with pytest.raises(InvalidRequest, match="multipart/form-data"):
            UploadForm(content_type, NewFile(tmp_path, "k", "batch"), LineCheck(1), 10)
