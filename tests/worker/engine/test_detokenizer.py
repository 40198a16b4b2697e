"""Incremental detokenizer on the demo byte-level BPE tokenizer: final text only, stops cut exactly."""
import copy
import random

import pytest

from worker.engine.detokenizer import IncrementalDetokenizer, window_decoder
from worker.models.demo import train_tokenizer

MIXED = "Héllo wörld 你好 😀 model token 🎉 中文 café, the cache block stream"


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


def ids_of(tok, text):
    return tok.encode(text, add_special_tokens=False)


def feed(tok, ids, stop=(), include=False, prompt=(), min_tokens=0):
    """Add one token at a time; return (detokenizer, deltas)."""
    d = IncrementalDetokenizer(tok, list(prompt), list(stop), include, min_tokens)
    return d, [d.add([t]) for t in ids]


def test_deltas_and_flush_reassemble_the_full_decode(tok):
    ids = ids_of(tok, MIXED)
    d, deltas = feed(tok, ids, prompt=ids_of(tok, "A prompt first"))
    tail = d.flush()
    assert "".join(deltas) + tail == tok.decode(ids) == MIXED
    assert not d.stopped


def test_adding_several_tokens_at_once_gives_the_same_text(tok):
    ids = ids_of(tok, MIXED)
    d = IncrementalDetokenizer(tok, [], [], False)
    out = "".join(d.add(ids[i:i + 3]) for i in range(0, len(ids), 3)) + d.flush()
    assert out == MIXED


@pytest.mark.parametrize("char", ["🎉", "中", "ж"])
def test_a_character_split_across_tokens_is_never_emitted_half(tok, char):
    ids = ids_of(tok, f"model {char}{char} token")
    assert len(ids_of(tok, char)) > 1, "pick a character the demo vocab splits into bytes"
    d, deltas = feed(tok, ids)
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) + d.flush() == f"model {char}{char} token"


def test_stop_string_spanning_tokens_is_excluded(tok):
    text, stop = "the cache block stream worker", "ck str"
    ids = ids_of(tok, text)
    spans = [tok.decode([t]) for t in ids]
    assert not any(stop in s for s in spans), "the stop string must span a token boundary"
    d, deltas = feed(tok, ids, stop=[stop])
    assert d.stopped and "".join(deltas) == "the cache blo"
    assert d.add(ids_of(tok, " more")) == "" and d.flush() == ""


def test_stop_string_included_when_asked(tok):
    d, deltas = feed(tok, ids_of(tok, "the cache block stream worker"), stop=["ck str"], include=True)
    assert d.stopped and "".join(deltas) == "the cache block str"


def test_nothing_after_the_stop_is_released_even_within_one_token(tok):
    d = IncrementalDetokenizer(tok, [], ["he"], False)
    assert d.add(ids_of(tok, "the cache")) == "t" and d.stopped


def test_the_stop_that_completes_first_wins(tok):
    d, deltas = feed(tok, ids_of(tok, "one two three four"), stop=["three four", "two"])
    assert "".join(deltas) == "one "


def test_a_stop_inside_the_first_min_tokens_tokens_text_is_ignored(tok):
    """vLLM's rule: stop strings are checked only past min_tokens ("the", " cache" both hold an "e");
    added one at a time or all at once, the same text."""
    ids = ids_of(tok, "the cache block stream")
    assert [tok.decode([t]) for t in ids] == ["the", " cache", " block", " stream"]
    d, deltas = feed(tok, ids, stop=["e"], min_tokens=2)
    assert d.stopped and "".join(deltas) == "the cache block str"
    at_once = IncrementalDetokenizer(tok, ids_of(tok, "A prompt"), ["e"], False, min_tokens=2)
    assert at_once.add(ids) == "the cache block str" and at_once.stopped


def test_a_stop_that_ends_past_the_first_min_tokens_tokens_counts_from_where_it_began(tok):
    """As vLLM's lookback: the first "he c" lies inside the first three tokens' text and is ignored;
    the second begins inside it ("the") and ends past it (" cache"), and cuts there."""
    ids = ids_of(tok, "the cache the cache block")
    assert [tok.decode([t]) for t in ids] == ["the", " cache", " the", " cache", " block"]
    d, deltas = feed(tok, ids, stop=["he c"], min_tokens=3)
    assert d.stopped and "".join(deltas) == "the cache t"


def test_possible_stop_prefix_is_held_then_released(tok):
    ids = ids_of(tok, "the block stream")
    d = IncrementalDetokenizer(tok, [], ["block queue"], False)
    released = []
    for t in ids:
        released.append(d.add([t]))
        if tok.decode(ids[: len(released)]) == "the block":
            assert "".join(released) == "the "  # "block" could still become "block queue"
    assert "".join(released) == "the block stream" and not d.stopped
    assert d.flush() == ""


def test_flush_releases_a_held_stop_prefix(tok):
    d, deltas = feed(tok, ids_of(tok, "the cache blo"), stop=["block"])
    assert "".join(deltas) == "the cache " and d.flush() == "blo"
    assert not d.stopped


def test_special_tokens_are_not_rendered(tok):
    ids = ids_of(tok, "hello") + [tok.eos_token_id]
    d, deltas = feed(tok, ids)
    assert "".join(deltas) + d.flush() == "hello"


def test_the_rust_decode_is_the_wrappers_on_any_window(tok):
    """The windows are decoded by the Rust tokenizer directly (worker/engine/detokenizer.py
    `window_decoder`); on any window of ids, special tokens and split characters included, its text
    is what transformers' decode gives with the same options."""
    fast = window_decoder(tok)
    assert fast.func == tok.backend_tokenizer.decode, "this tokenizer decodes through Rust directly"
    rng = random.Random(3)
    ids = ids_of(tok, MIXED) + [tok.eos_token_id] + ids_of(tok, " café 😀 tail") + [tok.bos_token_id]
    for _ in range(300):
        start = rng.randrange(len(ids))
        window = ids[start:start + rng.randrange(1, 8)] if rng.random() < 0.8 else \
            [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 6))]
        assert fast(window) == tok.decode(window, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_a_tokenizer_with_its_own_decoding_keeps_it(tok):
    """A class that decodes its own way (or any tokenizer that is not a Rust one) is not bypassed."""

    class Shouting(type(tok)):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    shouting = copy.copy(tok)
    shouting.__class__ = Shouting
    d, deltas = feed(shouting, ids_of(tok, "hello there"))
    assert "".join(deltas) + d.flush() == "HELLO THERE"
