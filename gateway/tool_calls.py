"""Tool calls, gateway side: what `tool_choice` asks of the output, and how one choice's output
becomes OpenAI's `content` and `tool_calls`, streamed or whole.

`required` and a named function are forced by a JSON-schema constraint (vLLM's approach): named,
the output is the function's arguments; required, an array of `{"name", "parameters"}`, one item at
most when `parallel_tool_calls` is false. The gateway wrote the constraint, so it parses the output
itself. `auto` leaves the output free and runs the model family's parser (its workers register
which); `none` renders the tools and parses nothing.
"""
from __future__ import annotations

import secrets
from typing import Any

import orjson

from gateway.agent_schemas import NamedToolChoice, Tool
from shared import tool_parsers as tp
from shared.errors import InvalidRequest
from shared.sampling import StructuredOutputs

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # a function declared without parameters


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else ANY_OBJECT


def forced(tools: list[Tool] | None, choice, parallel: bool) -> StructuredOutputs | None:
    """The constraint `tool_choice` asks for (None: the output stays free); 400 for a choice that
    names no tool of the request, or asks for calls without tools."""
    if choice is None or choice in ("none", "auto"):
        return None
    if not tools:
        raise InvalidRequest("tool_choice asks for a tool call, but the request has no tools",
                             param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        return StructuredOutputs(json=orjson.dumps(_parameters(named(tools, choice))).decode())
    item = {"anyOf": [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [t.function.name]}, "parameters": _parameters(t)},
        "required": ["name", "parameters"]} for t in tools]}
    array = {"type": "array", "items": item, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    return StructuredOutputs(json=orjson.dumps(array).decode())


def named(tools: list[Tool], choice: NamedToolChoice) -> Tool:
    for tool in tools:
        if tool.function.name == choice.function.name:
            return tool
    raise InvalidRequest(f"tool_choice names the function '{choice.function.name}', which is not "
                         f"among the request's tools", param="tool_choice")


def check(tools: list[Tool] | None, choice, parser: str | None) -> None:
    """400 for tools kvgate cannot serve: a type other than function, a name twice, or `auto` on a
    model whose workers register no parser to find calls with. (Whether their parameters are JSON
    schemas is the checker's to say: gateway/checker.py.)"""
    seen: set[str] = set()
    for i, tool in enumerate(tools or ()):
        if tool.type != "function":
            raise InvalidRequest(f"tools[{i}] is of type '{tool.type}'; only function tools are "
                                 f"served", param=f"tools.{i}.type")
        if tool.function.name in seen:
            raise InvalidRequest(f"tools[{i}]: the function name '{tool.function.name}' is used "
                                 f"twice", param=f"tools.{i}.function.name")
        seen.add(tool.function.name)
    if tools and choice == "auto" and parser is None:
        raise InvalidRequest("tool_choice auto needs a tool-call parser for this model, and its "
                             "workers register none (--tool-call-parser); use tool_choice "
                             "\"required\" or a named function, which kvgate enforces itself",
                             param="tool_choice")


class _Plain:
    """No tools, or `tool_choice: none`: all of it is content."""

    def feed(self, text: str) -> list[tp.Event]:
        return [tp.Content(text)] if text else []

    def finish(self) -> list[tp.Event]:
        return []


class _Named(_Plain):
    """A forced named call: the whole output is its arguments."""

    def __init__(self, name: str):
        self.name, self.started = name, False

    def feed(self, text: str) -> list[tp.Event]:
        if not text:
            return []
        start = [] if self.started else [tp.CallStart(0, self.name)]
        self.started = True
        return [*start, tp.CallArguments(0, text)]


class _Forced(tp.ToolParser):
    """A forced `required`: a JSON array of `{"name": ..., "parameters": {...}}` objects."""

    KEYS = ("parameters",)

    def __init__(self):
        super().__init__()
        self.state = "open"

    def _open(self, out: list[tp.Event]) -> bool:
        pos = tp.literal(self.buf, 0, ("[",))
        if not isinstance(pos, int):
            self.state = "text" if pos is None else "open"
            return pos is None
        self.buf, self.state = self.buf[pos:], "header"
        return True

    def _tail(self, out: list[tp.Event]) -> bool:
        pos = tp.literal(self.buf, 0, ("}",))
        pos = tp.literal(self.buf, pos, (",", "]")) if isinstance(pos, int) else pos
        if not isinstance(pos, int):
            return False
        closed = self.buf[pos - 1] == "]"
        self.buf, self.state = self.buf[pos:], "text" if closed else "header"
        return True

    def _text(self, out: list[tp.Event]) -> bool:
        self._content(out, self.buf)
        self.buf = ""
        return False

    def _buffered(self, out: list[tp.Event]) -> bool:
        return False

    def finish(self) -> list[tp.Event]:
        """A cut output (max_tokens) leaves its calls as they stand; what never became one stays."""
        out: list[tp.Event] = []
        if self.state in ("text", "buffered", "open") and self.buf.strip():
            out.append(tp.Content(self.buf))
        self.buf = ""
        return out


def reader(tools: list[Tool] | None, choice, parser: str | None):
    """What turns one choice's text into content and calls under this request's tool_choice."""
    if not tools or choice == "none":
        return _Plain()
    if isinstance(choice, NamedToolChoice):
        return _Named(choice.function.name)
    if choice == "required":
        return _Forced()
    return tp.make(parser) if parser else _Plain()


class CallIds:
    """One id per call of one choice, `call_<hex>`, given at its start."""

    def __init__(self):
        self.ids: dict[int, str] = {}

    def start(self, index: int) -> str:
        return self.ids.setdefault(index, f"call_{secrets.token_hex(12)}")


def delta(events: list[tp.Event], ids: CallIds) -> dict[str, Any]:
    """OpenAI's streamed `delta` for these events: content joined; per call, its id, type and name
    first, then its arguments in pieces."""
    out: dict[str, Any] = {}
    content = "".join(e.text for e in events if isinstance(e, tp.Content))
    if content:
        out["content"] = content
    calls: dict[int, dict[str, Any]] = {}
    for e in events:
        if isinstance(e, tp.CallStart):
            calls[e.index] = {"index": e.index, "id": ids.start(e.index), "type": "function",
                              "function": {"name": e.name, "arguments": ""}}
        elif isinstance(e, tp.CallArguments):
            call = calls.setdefault(e.index, {"index": e.index, "function": {"arguments": ""}})
            call["function"]["arguments"] += e.text
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out


def message(events: list[tp.Event], ids: CallIds) -> dict[str, Any]:
    """OpenAI's whole `message`: content null when the output is only calls."""
    content, calls = tp.collect(events)
    if not calls:
        return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": content.strip() or None, "tool_calls": [
        {"id": ids.start(i), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for i, c in enumerate(calls)]}


def finish_reason(reason: str | None, calls_made: bool) -> str | None:
    """A call ends the turn with "tool_calls"; a cut one keeps "length" (its arguments are cut)."""
    return "tool_calls" if calls_made and reason == "stop" else reason


class ChoiceOutput:
    """One choice's text on its way to the client: its reader, the ids of its calls, and whether it
    made any (its finish_reason then says so). `parallel: false` keeps the first call of a model
    that wrote several under `auto` (a forced one cannot: its grammar allows one)."""

    def __init__(self, reader, parallel: bool = True):
        self.reader, self.ids, self.calls_made = reader, CallIds(), False
        self.parallel = parallel

    def _events(self, text: str, last: bool) -> list[tp.Event]:
        events = self.reader.feed(text) + (self.reader.finish() if last else [])
        if not self.parallel:
            events = [e for e in events if isinstance(e, tp.Content) or e.index == 0]
        self.calls_made |= any(isinstance(e, tp.CallStart) for e in events)
        return events

    def delta(self, text: str, last: bool) -> dict[str, Any]:
        return delta(self._events(text, last), self.ids)

    def message(self, text: str) -> dict[str, Any]:
        return message(self._events(text, True), self.ids)

    def finish_reason(self, reason: str | None) -> str | None:
        return finish_reason(reason, self.calls_made)
