"""The thinking/answer split of one choice's released text: by the marker tokens, wherever the
detokenizer released their text; the markers themselves in neither part."""
from __future__ import annotations

import pytest

from worker.models.demo import train_tokenizer
from worker.thinking import Markers, ThinkingSplit

START, END = 100, 101
KEPT = Markers(START, END, "<think>", "</think>")  # Qwen's: markers decode into the text
SKIPPED = Markers(START, END, "", "")  # special tokens the detokenizer skips


def run(split: ThinkingSplit, outputs: list[tuple[list[int], str]]) -> list[tuple[str, str]]:
    return [split.add(ids, text, final=i == len(outputs) - 1) for i, (ids, text) in enumerate(outputs)]


def test_the_demo_tokenizers_markers():
    markers = Markers.of(train_tokenizer(), "qwen3")
    assert markers == Markers(2044, 2045, "<think>", "</think>")
    assert markers.thinking([1, 2044, 5]) and not markers.thinking([1, 2044, 5, 2045, 6])


@pytest.mark.parametrize("markers", [KEPT, SKIPPED], ids=["kept", "skipped"])
def test_thinking_then_answer(markers):
    split = markers.split([7, START, 8], [])
    got = run(split, [([1], "Hmm"), ([2], ", so"), ([END], markers.end_text), ([3], "Yes"), ([4], ".")])
    assert got == [("Hmm", ""), (", so", ""), ("", ""), ("", "Yes"), ("", ".")]


def test_text_released_late_is_cut_where_the_marker_text_is():
    """The detokenizer held ' s' back (a possible stop string) and released it with the marker."""
    split = KEPT.split([START], [])
    got = run(split, [([1], "ok"), ([END], " s</think>"), ([2], "Sure")])
    assert got == [("ok", ""), (" s", ""), ("", "Sure")]


def test_a_marker_whose_text_comes_in_pieces_is_held_until_whole():
    split = KEPT.split([START], [])
    got = run(split, [([1], "a"), ([END], "b</th"), ([2], "ink>c"), ([3], "d")])
    assert got == [("a", ""), ("b", ""), ("", "c"), ("", "d")]


def test_without_a_start_in_the_prompt_it_answers_and_a_written_think_block_is_reasoning():
    split = KEPT.split([7, 8], [])
    got = run(split, [([1], "x"), ([START], "<think>"), ([2], "y"), ([END], "</think>"), ([3], "z")])
    assert got == [("", "x"), ("", ""), ("y", ""), ("", ""), ("", "z")]


def test_the_state_is_rebuilt_from_the_tokens_already_sent():
    assert KEPT.split([START], [1, 2]).thinking
    assert not KEPT.split([START], [1, END, 2]).thinking
    assert not KEPT.split([7, START, 8, END], []).thinking, "a template that closed it: answering"


def test_text_still_held_when_the_choice_ends_is_released():
    split = KEPT.split([START], [])
    assert split.add([END], "so </", final=False) == ("so ", "")
    assert split.add([9], "x", final=True) == ("</x", ""), "the marker never came: all of it thinking"
