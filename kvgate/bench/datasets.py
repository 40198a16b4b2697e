"""Workloads for `kvgate bench serve`: text prompts of exact token lengths, and when each is sent.

Prompts are built from "word tokens" of the served model's tokenizer (ids whose text is a space and
letters and that re-tokenize to themselves), so a prompt of n such words is n tokens (plus the
tokenizer's BOS) on the server. Without a tokenizer, common English words stand in (about a token
each); the server's `usage` gives the exact counts either way.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("random", "shared-prefix", "long-short", "burst")
_FALLBACK_WORDS = (" the of and to in is it you that he was for on are with as his they be at one have this"
                   " from or had by word but what some we can out other were all there when up use your how"
                   " said an each she which do their time if will way about many then them write would").split(" ")[1:]


@dataclass
class Request:
    prompt: str
    prompt_len: int  # tokens, as the server will count them when a tokenizer was given
    output_len: int
    label: str = ""


@dataclass
class DatasetOptions:
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0  # lengths drawn uniformly from [len·(1−r), len·(1+r)], as vLLM's random
    prefix_len: int = 256  # shared-prefix: tokens every prompt of a group starts with
    num_prefixes: int = 4  # shared-prefix: groups
    long_input_len: int = 1024  # long-short: the long prompts' length
    long_output_len: int = 16
    long_fraction: float = 0.25  # long-short: share of the requests that are long
    burst_size: int = 16  # burst: requests sent at the same instant
    burst_interval_s: float = 1.0  # burst: time between bursts


class Vocabulary:
    """Word tokens that concatenate into text of exactly as many tokens."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.words = self._word_tokens(tokenizer) if tokenizer is not None else [" " + w for w in _FALLBACK_WORDS]
        self.bos = self._bos_count(tokenizer)

    @staticmethod
    def _word_tokens(tokenizer) -> list[str]:
        words = []
        for token_id in range(min(len(tokenizer), 50_000)):
            text = tokenizer.decode([token_id])
            if re.fullmatch(r" [a-z]{2,}", text) and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
                words.append(text)
        return words or [" " + w for w in _FALLBACK_WORDS]

    @staticmethod
    def _bos_count(tokenizer) -> int:
        if tokenizer is None:
            return 0
        return len(tokenizer.encode("", add_special_tokens=True))

    def text(self, num_tokens: int, rng: random.Random) -> str:
        return "".join(rng.choice(self.words) for _ in range(max(1, num_tokens - self.bos)))

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=True))


def load_tokenizer(path: str | Path | None):
    if not path or not Path(path, "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _length(base: int, ratio: float, rng: random.Random) -> int:
    return max(1, rng.randint(int(base * (1 - ratio)), int(base * (1 + ratio))))


def make_requests(name: str, n: int, opts: DatasetOptions, vocab: Vocabulary, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    if name in ("random", "burst"):
        return [_plain(vocab, rng, opts.input_len, opts.output_len, opts.range_ratio, name) for _ in range(n)]
    if name == "shared-prefix":
        prefixes = [vocab.text(opts.prefix_len, rng) for _ in range(max(1, opts.num_prefixes))]
        out = []
        for i in range(n):
            text = prefixes[i % len(prefixes)] + vocab.text(_length(opts.input_len, opts.range_ratio, rng) + vocab.bos, rng)
            out.append(Request(text, vocab.count(text), _length(opts.output_len, opts.range_ratio, rng),
                               f"prefix{i % len(prefixes)}"))
        return out
    if name == "long-short":
        num_long = round(n * opts.long_fraction)
        kinds = ["long"] * num_long + ["short"] * (n - num_long)
        rng.shuffle(kinds)
        return [_plain(vocab, rng, opts.long_input_len, opts.long_output_len, 0.0, "long") if k == "long"
                else _plain(vocab, rng, opts.input_len, opts.output_len, opts.range_ratio, "short") for k in kinds]
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


def _plain(vocab: Vocabulary, rng: random.Random, input_len: int, output_len: int, ratio: float,
           label: str) -> Request:
    text = vocab.text(_length(input_len, ratio, rng), rng)
    return Request(text, vocab.count(text), _length(output_len, ratio, rng), label)


def send_times(name: str, n: int, rate: float, opts: DatasetOptions, burstiness: float = 1.0,
               seed: int = 0) -> list[float]:
    """Seconds after the start at which each request is sent. Poisson arrivals at `rate` (gamma
    intervals with shape `burstiness`, as vLLM); all at once for an infinite rate; the burst dataset
    sends `burst_size` at once every `burst_interval_s` (or every burst_size/rate s if a rate is given)."""
    if name == "burst":
        interval = opts.burst_size / rate if rate != float("inf") else opts.burst_interval_s
        return [(i // opts.burst_size) * interval for i in range(n)]
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, times = 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times
