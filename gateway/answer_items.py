"""One choice's replies as the items Responses and Messages speak of: reasoning, text, and function
calls, in the order the model wrote them. Text becomes content and calls through the request's
ChoiceOutput (gateway/tool_calls.py), as on chat, so every API finds the same calls in the same text.
A stream and a whole reply are fed the same way, so they give the same items.

Each item is opened, appended to piece by piece, and closed; the events say which (`Open`,
`Append`, `Close`), and each API writes them as its own stream events.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

from gateway.tool_calls import ChoiceOutput
from shared import protocol

Kind = Literal["reasoning", "text", "call"]


@dataclass
class Item:
    kind: Kind
    index: int  # its place among the choice's items
    call_id: str | None = None
    name: str | None = None
    closed: bool = False
    cut: bool = False  # the reply ended while it was being written (max tokens, an error): incomplete
    pieces: list[str] = field(default_factory=list)  # joined when read: `text += piece` for every
    # token copied the whole text each time (a 128k-token answer: 3.4 s of the event loop)

    @property
    def text(self) -> str:
        """The reasoning, the text, or the call's arguments (JSON text), so far."""
        if len(self.pieces) > 1:
            self.pieces[:] = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""


@dataclass(frozen=True)
class Open:
    item: Item


@dataclass(frozen=True)
class Append:
    item: Item
    piece: str


@dataclass(frozen=True)
class Close:
    item: Item


Event = Union[Open, Append, Close]


@dataclass
class Items:
    """`stops`: the request's stop sequences, asked with include_stop_str_in_output so the finishing
    text shows which one ended it (Anthropic's `stop_sequence`); cut off here, never rendered."""

    output: ChoiceOutput
    stops: list[str] = field(default_factory=list)
    items: list[Item] = field(default_factory=list)
    finish_reason: str | None = None  # chat's: stop, length, tool_calls
    stop_sequence: str | None = None
    _open: Item | None = None
    _held: str = ""  # whitespace that opens no text item unless text follows (before a call: none)
    _calls: dict[int, Item] = field(default_factory=dict)  # the parser's call index -> its item

    def feed(self, reply: protocol.Delta) -> list[Event]:
        events: list[Event] = []
        reasoning, text = reply.reasoning or "", reply.text
        if reply.finish_reason == "stop":
            reasoning, text = self._cut_stop(reasoning, text)
        if reasoning:
            events += self._add("reasoning", reasoning)
        last = reply.finish_reason is not None
        delta = self.output.delta(text, last)
        if delta.get("content"):
            events += self._text(delta["content"])
        for call in delta.get("tool_calls", ()):
            events += self._call(call)
        if last:
            self.finish_reason = self.output.finish_reason(reply.finish_reason)
            events += self._close(cut=reply.finish_reason != "stop")
        return events

    def close(self) -> list[Event]:
        """The reply ended without a finish reason (an error): what is open is closed, cut."""
        return self._close(cut=True)

    def _cut_stop(self, reasoning: str, text: str) -> tuple[str, str]:
        """The finishing (reasoning, text) without the stop sequence that ends them: a stop matched in
        the thinking ends the thinking and leaves no text (chat's reasoning_content ends there too)."""
        written = reasoning + text
        for stop in self.stops:  # in the request's order: the detokenizer's tie-break
            if written.endswith(stop):
                self.stop_sequence = stop
                keep = len(written) - len(stop)
                return reasoning[:keep], text[:max(keep - len(reasoning), 0)]
        return reasoning, text

    def _text(self, content: str) -> list[Event]:
        if self._open is None or self._open.kind != "text":
            if not content.strip():
                self._held += content
                return []
            content, self._held = self._held + content, ""
            return self._add("text", content)
        return self._add("text", content)

    def _call(self, call: dict) -> list[Event]:
        function = call.get("function") or {}
        if "id" in call:  # a call's first piece: its id and name
            events = self._close()
            self._held = ""
            item = Item("call", len(self.items), call_id=call["id"], name=function.get("name"))
            self.items.append(item)
            self._calls[call["index"]] = self._open = item
            events.append(Open(item))
        else:
            events, item = [], self._calls[call["index"]]
        if function.get("arguments"):
            item.pieces.append(function["arguments"])
            events.append(Append(item, function["arguments"]))
        return events

    def _add(self, kind: Kind, piece: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open.kind != kind:
            events += self._close()
            self._open = Item(kind, len(self.items))
            self.items.append(self._open)
            events.append(Open(self._open))
        self._open.pieces.append(piece)
        events.append(Append(self._open, piece))
        return events

    def _close(self, cut: bool = False) -> list[Event]:
        if self._open is None:
            return []
        item, self._open = self._open, None
        item.closed, item.cut = True, cut
        return [Close(item)]
