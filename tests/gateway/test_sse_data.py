"""An event's data line stays one line for every line splitter: JSON allows U+0085, U+2028 and
U+2029 raw (orjson writes them so), and str.splitlines, which httpx's aiter_lines and many
hand-written SSE clients use, breaks a line at each. A model generated one in a cluster test's
stream, and the client read half an event."""
import orjson
import pytest

from gateway.answer_io import sse
from gateway.openai_api import _event, sse_data

TEXT = "a\u2028b\x85c\u2029d — é ✓ 😀 \n\t\"quoted\""


@pytest.mark.parametrize("event", [_event({"text": TEXT}, b"id: 7\n"), sse("content_block_delta", {"text": TEXT})])
def test_the_data_line_survives_splitlines_and_decodes_to_the_same_text(event):
    data = [line for line in event.decode().splitlines() if line.startswith("data: ")]
    assert len(data) == 1
    assert orjson.loads(data[0][6:]) == {"text": TEXT}


def test_only_the_three_are_escaped_and_ascii_json_is_orjsons_own():
    assert sse_data({"a": "plain"}) == orjson.dumps({"a": "plain"})
    assert sse_data("é\u2028") == b'"\xc3\xa9\\u2028"'
    assert b"\xe2\x80\xa8" not in sse_data(["\u2028"]) and b"\xc2\x85" not in sse_data({"k\x85": 1})
