"""Reasoning parsers: the markers around a model's thinking (`--reasoning-parser`). The engine keeps a
structured-output constraint off while a request is thinking; the worker sends thinking text as a
delta's `reasoning`, apart from the answer's `text`. Both follow `thinking()` of the same tokens, so
they agree, and both can rebuild their state from the tokens alone (after preemption or takeover).

gpt-oss writes OpenAI's harmony format instead (`harmony`): a reply is messages, each a header (the
role, `<|channel|>` and the channel's name, maybe a recipient and `<|constrain|>`) then
`<|message|>` and the body, ended by `<|end|>` (another message follows, from `<|start|>`),
`<|return|>` or `<|call|>`. The analysis channel's bodies are the thinking, the final channel's the
answer, a header is neither; `Harmony` follows where a reply is, token by token.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Markers:
    start: str
    end: str


# name -> markers; each is one special token of the families that use it
PARSERS: dict[str, Markers] = {
    "qwen3": Markers("<think>", "</think>"),
    "deepseek_r1": Markers("<think>", "</think>"),
}


HARMONY = "harmony"
# harmony's special tokens, in the order HarmonyIds takes their ids
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
THINKING_CHANNELS = ("analysis",)  # the bodies that are thinking; the final channel's are the answer
MAX_HEADER = 64  # tokens; a "header" longer than any harmony writes is a model not writing harmony: the answer


def detect(chat_template: str | None) -> str | None:
    """The parser a chat template implies: one that writes <think> thinks (Qwen3, DeepSeek-R1); one
    that writes harmony's channels is gpt-oss's."""
    if chat_template and "<|channel|>" in chat_template and "<|message|>" in chat_template:
        return HARMONY
    return "qwen3" if chat_template and "<think>" in chat_template else None


@dataclass(frozen=True)
class HarmonyIds:
    start: int
    channel: int
    message: int
    end: int
    ret: int
    call: int
    constrain: int


class Harmony:
    """Where a harmony reply is after each token: in a header (`body` None) or in a message body of
    channel `body` ("analysis", "final", "commentary", ...). `decode` turns a header's ids into text
    (its channel's name is the first word after `<|channel|>`). Built from the prompt: what follows
    its last `<|start|>` (the template ends it with `<|start|>assistant`, the header the reply goes on).
    A header past MAX_HEADER tokens was not one: from there on the reply is the final answer's text."""

    def __init__(self, ids: HarmonyIds, decode: Callable[[list[int]], str], prompt_ids: Sequence[int] = ()):
        self.ids, self.decode = ids, decode
        self.body: str | None = None
        self.recipient: str | None = None  # the body's, from its header's `to=` (a tool call: functions.NAME)
        self.header: list[int] = []  # the current header's tokens after its <|channel|>
        self.role: list[int] = []  # and the rest of them (the role, a recipient, <|constrain|>'s type)
        self.header_len = 0  # the current header's tokens
        self.in_channel = False
        self.started = False  # a message begun: the prompt ended in one (no <|start|>: plain text, the answer)
        tail = list(prompt_ids)
        for i in range(len(tail) - 1, -1, -1):
            if tail[i] == ids.start:
                self.started = True
                for token in tail[i:]:
                    self.feed(token)
                break

    def feed(self, token: int) -> str:
        """Advance by one token; what it was: "special" (no text of its own), "header" or "body"."""
        ids = self.ids
        if token == ids.message:
            self._read_header()
            self.header, self.role, self.in_channel, self.header_len = [], [], False, 0
            return "special"
        if token in (ids.start, ids.end, ids.ret, ids.call):
            self.body, self.recipient, self.header, self.role = None, None, [], []
            self.in_channel, self.started, self.header_len = False, True, 0
            return "special"
        if token in (ids.channel, ids.constrain):  # the channel's name follows one; a type the other
            self.body, self.in_channel = None, token == ids.channel
            return "special"
        if self.body is not None or not self.started:
            return "body"
        self.header_len += 1
        if self.header_len > MAX_HEADER:
            self.body = "final"
            return "body"
        (self.header if self.in_channel else self.role).append(token)
        return "header"

    @property
    def thinking(self) -> bool:
        """Not (yet) in the answer: in a header, or in a body other than the final channel's."""
        return self.started and self.body != "final"

    def _read_header(self) -> None:
        """The body's channel (the first word after `<|channel|>`) and recipient (`to=` in the header,
        before the channel, `<|start|>assistant to=functions.f<|channel|>…`, or after its name,
        `<|channel|>commentary to=functions.f <|constrain|>json`), each header part decoded once."""
        channel = self.decode(self.header).split()
        self.body = channel[0] if channel else ""
        words = self.decode(self.role).split() + channel
        self.recipient = next((w[3:] for w in words if w.startswith("to=")), None)

    @property
    def calling(self) -> str | None:
        """The function a tool call's body is the arguments of (`to=functions.NAME`), else None."""
        if self.body is not None and self.recipient and self.recipient.startswith("functions."):
            return self.recipient.removeprefix("functions.") or None
        return None


def thinking(prompt_ids: Sequence[int], output_ids: Sequence[int], start_id: int, end_id: int) -> bool:
    """Still thinking after `output_ids`: a reply thinks only when its prompt opened a thinking block
    (the latest marker in the prompt is a start: the template wrote <think>), and only until the first
    end marker it writes. A template that closes the block in the prompt (thinking disabled) or writes
    no marker starts the reply answering; markers written later are text, so an answer, or a JSON
    string the grammar allows, can hold "<think>" without turning the constraint off."""
    return _opened(prompt_ids, start_id, end_id) and end_id not in output_ids


def _opened(prompt_ids: Sequence[int], start_id: int, end_id: int) -> bool:
    for token in reversed(prompt_ids):
        if token == end_id:
            return False
        if token == start_id:
            return True
    return False
