"""Each choice's text split into thinking (a delta's `reasoning`) and the answer (its `text`), for a
model with a reasoning parser. Which part a token belongs to is `shared.reasoning.thinking()` of the
tokens, the rule the engine's structured-output gate keeps too; the text only says where a marker
token's own text lies in what the detokenizer released, which can be later than the token itself (it
holds back half a character, or a possible stop string). The markers appear in neither part.

The state is rebuilt from the prompt and the tokens already emitted, so a preempted or taken-over
request splits its text on as before.
"""
from __future__ import annotations

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
    def of(cls, tokenizer, parser: str) -> Markers | None:
        """None when the tokenizer has no single token for each marker."""
        from worker.engine.tokenizer import marker_ids

        words = reasoning.PARSERS[parser]
        ids = marker_ids(tokenizer, (words.start, words.end))
        if ids is None:
            return None
        start_text, end_text = (tokenizer.decode([i], skip_special_tokens=True) for i in ids)
        return cls(ids[0], ids[1], start_text, end_text)

    def thinking(self, token_ids: Sequence[int]) -> bool:
        return reasoning.thinking(token_ids, self.start_id, self.end_id)

    def split(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> ThinkingSplit:
        """The split of a choice whose prompt is `prompt_ids`, having emitted `output_ids` already."""
        return ThinkingSplit(self, self.thinking([*prompt_ids, *output_ids]))


class ThinkingSplit:
    """One choice's state: thinking or not, and the marker tokens whose text is still to come."""

    def __init__(self, markers: Markers, thinking: bool):
        self.m, self.thinking = markers, thinking
        self.due: list[int] = []  # marker tokens emitted whose text has not been released yet
        self.held = ""  # released text that may be the start of the next due marker's text

    def add(self, token_ids: Sequence[int], text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, answer) of the text released with `token_ids`; `final`: the choice ended."""
        self.due += [t for t in token_ids if t in (self.m.start_id, self.m.end_id)]
        parts, text, self.held = ([], []), self.held + text, ""
        while self.due:
            mark = self.m.start_text if self.due[0] == self.m.start_id else self.m.end_text
            at = text.find(mark) if mark else 0  # a skipped marker: what came with it precedes it
            if at < 0:
                keep = 0 if final else _partial(text, mark)
                parts[self.thinking].append(text[:len(text) - keep])
                self.held = text[len(text) - keep:]
                return "".join(parts[True]), "".join(parts[False])
            parts[self.thinking].append(text[:at] if mark else text)
            text = text[at + len(mark):] if mark else ""
            self.thinking = self.due.pop(0) == self.m.start_id
        parts[self.thinking].append(text)
        return "".join(parts[True]), "".join(parts[False])


def _partial(text: str, mark: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `mark`."""
    for n in range(min(len(mark) - 1, len(text)), 0, -1):
        if text.endswith(mark[:n]):
            return n
    return 0
