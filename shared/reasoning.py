"""Reasoning parsers: the markers around a model's thinking (`--reasoning-parser`). The engine keeps a
structured-output constraint off while a request is thinking; the worker sends thinking text as a
delta's `reasoning`, apart from the answer's `text`. Both ask `thinking()` of the same tokens, so
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


def thinking(token_ids: Sequence[int], start_id: int, end_id: int) -> bool:
    """Inside a thinking block after these tokens (prompt then output): the latest marker is a start.
    A template that opens <think> in the prompt starts the output thinking; one that closes it there
    (thinking disabled), or a prompt without markers, starts it answering."""
    for token in reversed(token_ids):
        if token == end_id:
            return False
        if token == start_id:
            return True
    return False
