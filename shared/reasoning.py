"""Reasoning parsers: the markers around a model's thinking (`--reasoning-parser`). The engine keeps a
structured-output constraint off while a request is thinking; the worker sends thinking text as a
delta's `reasoning`, apart from the answer's `text`. Both follow `thinking()` of the same tokens, so
they agree, and both can rebuild their state from the tokens alone (after preemption or takeover).
"""
from __future__ import annotations

from collections.abc import Sequence
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


def detect(chat_template: str | None) -> str | None:
    """The parser a chat template implies: one that writes <think> thinks (Qwen3, DeepSeek-R1)."""
    return "qwen3" if chat_template and "<think>" in chat_template else None


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
