"""Tool-call parsers per model family (`--tool-call-parser`): they find the calls a model writes in its
own format in the text it streams, and turn them into OpenAI's `tool_calls`. A small registry that a
new family plugs into (issue 17); the gateway runs the parser its workers register.

A parser is fed the text as it streams and answers events: `Content` (text that is not a call),
`CallStart` (a call's function name, sent first) and `CallArguments` (its arguments, in pieces).
Text that may still turn out to be a call is held back, and released as content when it does not
(`finish()` releases what is left). Once a call's name and the opening `{` of its arguments are
seen it is a call: its arguments stream as written, and a malformed tail cannot take it back.
A non-streamed response feeds the whole text at once (`parse()`): one code path for both.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Union

NAMES = ("hermes", "llama3")  # the families implemented: Hermes/Qwen <tool_call>{...}</tool_call>, Llama 3.x JSON


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str


Event = Union[Content, CallStart, CallArguments]


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's function.arguments


MORE = "more"  # the text so far could still become what is expected: wait for more
# A call's header (`{"name": "<name>", "arguments": `) is parsed again from its start as each piece
# arrives; one still incomplete past this many characters (whitespace, a name no function has) is
# judged whole instead, as text that did not open a call is: the stream cannot make that quadratic.
HEADER_MAX = 1024
_WS = re.compile(r"[ \t\r\n]*")


def _skip_ws(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()


def literal(text: str, pos: int, options: tuple[str, ...]) -> int | str | None:
    """Position past whichever of `options` starts at `pos` (after whitespace), MORE, or None."""
    pos = _skip_ws(text, pos)
    for option in options:
        if text.startswith(option, pos):
            return pos + len(option)
    rest = text[pos:pos + max(map(len, options))]
    return MORE if len(text) - pos < max(map(len, options)) and any(o.startswith(rest) for o in options) else None


def _string(text: str, pos: int) -> tuple[str, int] | str | None:
    """A JSON string starting at `pos`: (its value, position past it), MORE, or None."""
    if pos >= len(text):
        return MORE
    if text[pos] != '"':
        return None
    i, escaped = pos + 1, False
    while i < len(text):
        if escaped:
            escaped = False
        elif text[i] == "\\":
            escaped = True
        elif text[i] == '"':
            try:
                return json.loads(text[pos:i + 1]), i + 1
            except ValueError:
                return None
        i += 1
    return MORE


def header(text: str, keys: tuple[str, ...]) -> tuple[str, int] | str | None:
    """`{"name": "<name>", "<key>": ` and the `{` after it at the start of `text`: (name, position of
    that `{`), MORE while it could still come, None when it cannot (another key order, say)."""
    pos = literal(text, 0, ("{",))
    for expected in ('"name"', ":"):
        if not isinstance(pos, int):
            return pos
        pos = literal(text, pos, (expected,))
    if not isinstance(pos, int):
        return pos
    name = _string(text, _skip_ws(text, pos))
    if not isinstance(name, tuple):
        return name
    pos = literal(text, name[1], (",",))
    if isinstance(pos, int):
        pos = literal(text, pos, tuple(f'"{k}"' for k in keys))
    if isinstance(pos, int):
        pos = literal(text, pos, (":",))
    if not isinstance(pos, int):
        return pos
    pos = _skip_ws(text, pos)
    if pos == len(text):
        return MORE
    return (name[0], pos) if text[pos] == "{" else None


class _ObjectEnd:
    """Finds where a JSON object ends in text fed piece by piece (depth back to 0, strings skipped)."""

    def __init__(self):
        self.depth, self.in_string, self.escaped = 0, False, False

    def feed(self, text: str) -> int | None:
        """The position in `text` just past the object's end, or None if it goes on."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


def _call_of(obj, keys: tuple[str, ...]) -> ParsedCall | None:
    """A decoded `{"name": ..., "<key>": {...}}` as a call, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in keys if k in obj), None)
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    try:
        return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))
    except (ValueError, RecursionError):  # nested too deep to write back
        return None


class ToolParser:
    """The streaming machinery both families share: a call's header, then its arguments streamed
    until the object closes. Subclasses say what surrounds calls."""

    KEYS: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self):
        self.buf = ""
        self.calls = 0  # calls emitted so far; the next one's index
        self.state = "text"
        self.scan: _ObjectEnd | None = None

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while getattr(self, f"_{self.state}")(out):
            pass
        return out

    def finish(self) -> list[Event]:
        raise NotImplementedError

    def _content(self, out: list[Event], text: str) -> None:
        if text and not (self.calls and not text.strip()):  # whitespace between calls is not content
            out.append(Content(text))

    def _header(self, out: list[Event]) -> bool:
        found = header(self.buf, self.KEYS)
        if found == MORE and len(self.buf) > HEADER_MAX:
            found = None
        if found == MORE:
            return self._header_waits(out)
        if found is None:
            self.state = "buffered"
            return True
        name, pos = found
        out.append(CallStart(self.calls, name))
        self.buf, self.state, self.scan = self.buf[pos:], "args", _ObjectEnd()
        return True

    def _header_waits(self, out: list[Event]) -> bool:
        return False

    def _args(self, out: list[Event]) -> bool:
        end = self.scan.feed(self.buf)
        piece = self.buf if end is None else self.buf[:end]
        if piece:
            out.append(CallArguments(self.calls, piece))
        self.buf = "" if end is None else self.buf[end:]
        if end is None:
            return False
        self.calls += 1
        self.state = "tail"
        return True

    def _emit_buffered(self, out: list[Event], calls: list[ParsedCall]) -> None:
        for call in calls:
            out.append(CallStart(self.calls, call.name))
            out.append(CallArguments(self.calls, call.arguments))
            self.calls += 1


class HermesParser(ToolParser):
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them,
    with text around them."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self.block: list[str] = []  # a block judged whole at its close: what came before `buf`

    def _text(self, out: list[Event]) -> bool:
        at = self.buf.find(self.START)
        if at >= 0:
            self._content(out, self.buf[:at])
            self.buf, self.state = self.buf[at + len(self.START):], "header"
            return True
        keep = _held_back(self.buf, self.START)
        self._content(out, self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _header_waits(self, out: list[Event]) -> bool:
        if self.END in self.buf:  # closed before a header could form: judge the whole block
            self.state = "buffered"
            return True
        return False

    def _tail(self, out: list[Event]) -> bool:
        at = self.buf.find(self.END)  # what stands between the arguments and the close is the `}`
        if at < 0:
            self.buf = self.buf[len(self.buf) - _held_back(self.buf, self.END):]  # dropped: not searched again
            return False
        self.buf, self.state = self.buf[at + len(self.END):], "text"
        return True

    def _buffered(self, out: list[Event]) -> bool:
        at = self.buf.find(self.END)
        if at < 0:  # set aside all but what could start the close, so each piece is searched once
            keep = _held_back(self.buf, self.END)
            self.block.append(self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        block = "".join(self.block) + self.buf[:at]
        self.block = []
        self.buf, self.state = self.buf[at + len(self.END):], "text"
        try:
            call = _call_of(json.loads(block), self.KEYS)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than Python decodes
            call = None
        if call is None:  # not a call after all: the model's text, as it wrote it
            out.append(Content(self.START + block + self.END))
        else:
            self._emit_buffered(out, [call])
        return True

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self.state == "text":
            self._content(out, self.buf)
        elif self.state in ("header", "buffered"):  # an unclosed block that never became a call
            out.append(Content(self.START + "".join(self.block) + self.buf))
        self.buf, self.block = "", []
        return out


class Llama3Parser(ToolParser):
    """Llama 3.x JSON: the whole output is `{"name": ..., "parameters": {...}}`, optionally after
    `<|python_tag|>`, several separated by `;`. An output that starts otherwise is content."""

    TAG = "<|python_tag|>"

    def __init__(self):
        super().__init__()
        self.state = "start"
        self.seen: list[str] = []  # everything fed, to give back whole if the output was not calls
        # after all; in pieces, as is what follows once buffered (`+=` copied the whole output for
        # every piece: quadratic in its length, on the gateway's event loop)
        self.rest: list[str] = []
        self.lead = 0  # how much of `buf` is known to be leading whitespace (not searched again)

    def feed(self, text: str) -> list[Event]:
        self.seen.append(text)
        if self.state == "buffered":  # judged whole at the end
            self.rest.append(text)
            return []
        return super().feed(text)

    def _start(self, out: list[Event]) -> bool:
        self.lead = _skip_ws(self.buf, self.lead)
        lead = self.buf[self.lead:]
        if lead.startswith(self.TAG):
            self.buf, self.state = lead[len(self.TAG):], "header"
        elif lead.startswith("{"):
            self.buf, self.state = lead, "header"
        elif lead and not self.TAG.startswith(lead):
            self.state = "text"
        else:
            return False
        return True

    def _text(self, out: list[Event]) -> bool:
        self._content(out, self.buf)
        self.buf = ""
        return False

    def _tail(self, out: list[Event]) -> bool:
        pos = _skip_ws(self.buf, 0)
        while pos < len(self.buf) and self.buf[pos] == "}":  # the call object's own close
            pos = _skip_ws(self.buf, pos + 1)
        if pos == len(self.buf):
            self.buf = ""
            return False
        if self.buf[pos] == ";":
            self.buf, self.state = self.buf[pos + 1:], "header"
        else:  # text after the calls: content
            self.buf, self.state = self.buf[pos:], "text"
        return True

    def _buffered(self, out: list[Event]) -> bool:
        return False  # judged whole at the end: the objects may hold `;` and braces in strings

    def finish(self) -> list[Event]:
        out: list[Event] = []
        self.buf, self.rest = self.buf + "".join(self.rest), []
        if self.state in ("text", "start"):
            self._content(out, self.buf)
        elif self.state in ("header", "buffered"):
            calls = _json_calls(self.buf, self.KEYS)
            if calls:
                self._emit_buffered(out, calls)
            elif self.calls:
                self._content(out, self.buf)
            else:
                out.append(Content("".join(self.seen)))
        self.buf = ""
        return out


def _json_calls(text: str, keys: tuple[str, ...]) -> list[ParsedCall] | None:
    """`{...}; {...}` as calls, or None unless every object is one."""
    decoder, pos, calls = json.JSONDecoder(), _skip_ws(text, 0), []
    while pos < len(text):
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):
            return None
        call = _call_of(obj, keys)
        if call is None:
            return None
        calls.append(call)
        pos = _skip_ws(text, pos)
        if pos < len(text) and text[pos] == ";":
            pos = _skip_ws(text, pos + 1)
        elif pos < len(text):
            return None
    return calls or None


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


# name -> parser class; a new family plugs in here (and in NAMES)
PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3": Llama3Parser}


def make(name: str) -> ToolParser:
    return PARSERS[name]()


def collect(events: list[Event]) -> tuple[str, list[ParsedCall]]:
    """The content and the calls a sequence of events adds up to."""
    content, calls = [], {}
    for e in events:
        if isinstance(e, Content):
            content.append(e.text)
        elif isinstance(e, CallStart):
            calls[e.index] = ParsedCall(e.name, "")
        else:
            calls[e.index].arguments += e.text
    return "".join(content), [calls[i] for i in sorted(calls)]


def parse(name: str, text: str) -> tuple[str, list[ParsedCall]]:
    """A whole output's content and calls (a non-streamed response)."""
    p = make(name)
    return collect(p.feed(text) + p.finish())


def detect(chat_template: str | None) -> str | None:
    """The parser a chat template implies, when it is recognisable."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return "llama3"
    return None
