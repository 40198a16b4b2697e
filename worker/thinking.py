"""Each choice's text split into thinking (a delta's `reasoning`) and the answer (its `text`), for a
model with a reasoning parser. Which part a token belongs to is `shared.reasoning.thinking()` of the
tokens, the rule the engine's structured-output gate keeps too; the text only says where a marker
token's own text lies in what the detokenizer released, which can be later than the token itself (it
holds back half a character, or a possible stop string). The markers appear in neither part.

The state is rebuilt from the prompt and the tokens already emitted, so a preempted or taken-over
request splits its text on as before.

gpt-oss's harmony replies (`HarmonySplit`) are split by channel instead: the analysis channel's
bodies are the thinking, the other bodies the answer, and the headers (role, channel, recipient)
neither.
"""
from __future__ import annotations

import json
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from shared import reasoning


@dataclass(frozen=True)
class Markers:
    """A reasoning parser's marker tokens in one tokenizer: their ids and decoded text ("" for a
    special token the detokenizer skips)."""

    start_id: int
    end_id: int
    start_text: str
    end_text: str

    @classmethod
    def of(cls, tokenizer, parser: str) -> Markers | HarmonyMarkers | None:
        """None when the tokenizer has no single token for each marker."""
        from worker.engine.tokenizer import marker_ids

        if parser == reasoning.HARMONY:
            return HarmonyMarkers.of(tokenizer)
        words = reasoning.PARSERS[parser]
        ids = marker_ids(tokenizer, (words.start, words.end))
        if ids is None:
            return None
        start_text, end_text = (tokenizer.decode([i], skip_special_tokens=True) for i in ids)
        return cls(ids[0], ids[1], start_text, end_text)

    def split(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> ThinkingSplit:
        """The split of a choice whose prompt is `prompt_ids`, having emitted `output_ids` already."""
        return ThinkingSplit(self, reasoning.thinking(prompt_ids, output_ids, self.start_id, self.end_id))


class ThinkingSplit:
    """One choice's state: thinking or not, and the marker tokens whose text is still to come."""

    def __init__(self, markers: Markers, thinking: bool):
        self.m, self.thinking = markers, thinking
        self.tokens_thinking = thinking  # as of the last token given (the text may lag behind)
        self.due: list[int] = []  # the end marker, emitted and its text not released yet
        self.held = ""  # released text that may be the start of the next due marker's text

    def add(self, token_ids: Sequence[int], text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, answer) of the text released with `token_ids`; `final`: the choice ended."""
        if self.tokens_thinking and self.m.end_id in token_ids:  # the one marker that switches
            self.due.append(self.m.end_id)
            self.tokens_thinking = False
        parts, text, self.held = ([], []), self.held + text, ""
        while self.due:
            mark = self.m.end_text
            at = text.find(mark) if mark else 0  # a skipped marker: what came with it precedes it
            if at < 0:
                keep = 0 if final else _partial(text, mark)
                parts[self.thinking].append(text[:len(text) - keep])
                self.held = text[len(text) - keep:]
                return "".join(parts[True]), "".join(parts[False])
            parts[self.thinking].append(text[:at] if mark else text)
            text = text[at + len(mark):] if mark else ""
            self.due.pop(0)
            self.thinking = False
        parts[self.thinking].append(text)
        return "".join(parts[True]), "".join(parts[False])


def _partial(text: str, mark: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `mark`."""
    for n in range(min(len(mark) - 1, len(text)), 0, -1):
        if text.endswith(mark[:n]):
            return n
    return 0


class HarmonyMarkers:
    """harmony's special tokens in one tokenizer, and how it decodes a header."""

    def __init__(self, ids: reasoning.HarmonyIds, tokenizer):
        self.ids, self.tokenizer = ids, tokenizer

    @classmethod
    def of(cls, tokenizer) -> HarmonyMarkers | None:
        from worker.engine.tokenizer import marker_ids

        ids = marker_ids(tokenizer, reasoning.HARMONY_TOKENS)
        return None if ids is None else cls(reasoning.HarmonyIds(*ids), tokenizer)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def split(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> HarmonySplit:
        state = reasoning.Harmony(self.ids, self.decode, prompt_ids)
        for token in output_ids:  # resumed: where the reply is, its text already sent
            state.feed(token)
        return HarmonySplit(self, state)


# a harmony tool call, as the Hermes parser reads one; where each part of a reply's text goes
CALL_START, CALL_END = '<tool_call>{{"name": {}, "arguments": ', "}</tool_call>"
_PART = {"reasoning": "reasoning", "answer": "answer", "call": "answer", "special": "answer", "drop": "drop"}


class HarmonySplit:
    """One choice's harmony reply, its released text routed by what each token was. The text comes
    later than its tokens (the detokenizer holds back half a character or a possible stop string), so
    tokens are kept in runs of one kind (a header's: dropped; a body's: thinking or answer); a run's
    length in characters is known when the next one starts (the decode of its ids: a byte-level
    vocabulary's text is its runs' texts end to end, special tokens none), and the text released
    goes to the runs in order. A tool call (a commentary body addressed `to=functions.NAME`) goes
    to the answer in the Hermes form the gateway's `hermes` tool parser reads — `<tool_call>{"name":
    NAME, "arguments": ` before the body, `}</tool_call>` after it — so it arrives as `tool_calls`."""

    def __init__(self, markers: HarmonyMarkers, state: reasoning.Harmony):
        self.m, self.state = markers, state
        self.closed: deque[list] = deque()  # [kind, characters still to come], in order
        self.kind = self._kind("body" if state.body is not None or not state.started else "header")
        self.run, self.taken = [], 0
        self.held = ""  # the open header's text: dropped when it closes, the answer's if it overflows

    def add(self, token_ids: Sequence[int], text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, answer) of the text released with `token_ids`."""
        parts = {"reasoning": [], "answer": [], "drop": []}
        for token in token_ids:
            what = self.state.feed(token)
            kind = "special" if what == "special" else self._kind(what)
            if kind != self.kind:
                overflowed = self.kind == "drop" and kind != "special"  # no header after all
                if overflowed:
                    self.kind = "answer"
                    parts["answer"].append(self.held)
                self.held, was_call = "", self.kind == "call"
                self._close()
                if was_call:
                    self.closed.append(["literal", CALL_END])
                if kind == "call":
                    self.closed.append(["literal", CALL_START.format(json.dumps(self.state.calling))])
                self.kind = kind
            if kind != "special":
                self.run.append(token)
        while self.closed:
            kind, left = self.closed[0]
            if kind == "literal":
                parts["answer"].append(left)
                self.closed.popleft()
                continue
            if not text:
                break
            parts[_PART[kind]].append(text[:left])
            text = text[left:]
            self.closed[0][1] = left = max(0, left - len(parts[_PART[kind]][-1]))
            if left == 0:
                self.closed.popleft()
        if text and self.kind == "drop":
            self.held += text
            self.taken += len(text)
        elif text:  # the current run's (past a special token, none yet: kept as answer, never lost)
            parts[_PART[self.kind]].append(text)
            self.taken += len(text)
        return "".join(parts["reasoning"]), "".join(parts["answer"])

    def _kind(self, what: str) -> str:
        if what == "header":
            return "drop"
        if self.state.calling:
            return "call"
        return "reasoning" if self.state.body in reasoning.THINKING_CHANNELS else "answer"

    def _close(self) -> None:
        """The current run is complete: what of its text has not come yet is due before the next's."""
        if self.run:
            left = len(self.m.decode(self.run)) - self.taken
            if left > 0:
                self.closed.append([self.kind, left])
        self.run, self.taken = [], 0
