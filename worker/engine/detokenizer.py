"""Incremental detokenizing with stop strings: text is released only once it is final.

Text is final when (1) it does not end in U+FFFD, which byte-level tokenizers produce for a UTF-8
character whose bytes are split across tokens, and (2) no suffix of it could still grow into a
stop string. Decoding a small window (prefix offset .. end) instead of the whole sequence keeps
each step cheap and lets tokenizers that add spaces by context decode the new tokens correctly.
Invariant: released text never ends in a proper prefix of a stop string, so any stop match lies
wholly inside the pending (unreleased) text.
min_tokens, as vLLM v1: a stop string counts only where its match ends past the text of the first
min_tokens tokens (it may begin inside it); a match wholly inside that text is ignored.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

REPLACEMENT_CHAR = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens decoded with the first output token, as vLLM does


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer, prompt_ids: list[int], stop: list[str], include_stop_str_in_output: bool,
        min_tokens: int = 0,
    ):
        self.tokenizer = tokenizer
        self._decode_ids = window_decoder(tokenizer)
        self.ids = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - _PROMPT_CONTEXT, 0)
        self.read_offset = len(self.ids)
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop_str_in_output
        self.pending = ""  # decoded, complete text held back because it may begin a stop string
        self.stopped = False
        self._num_prompt = len(self.ids)
        self.min_tokens = min_tokens
        self._early = 0  # the length of `pending` that is the first min_tokens tokens' text: no stop ends there

    def add(self, token_ids: list[int]) -> str:
        """Append generated tokens; return the text that became final."""
        if self.stopped:
            return ""
        early = max(0, min(len(token_ids), self.min_tokens - (len(self.ids) - self._num_prompt)))
        if early:  # decoded apart from the rest: where their text ends, stops may begin to end
            self._extend(token_ids[:early])
            self._early = len(self.pending)
        if len(token_ids) > early:
            self._extend(token_ids[early:])
        return self._release(final=False)

    def _extend(self, token_ids: list[int]) -> None:
        self.ids.extend(token_ids)
        self.pending += self._decode_new(final=False)

    def flush(self) -> str:
        """The sequence ended for another reason: release everything still held."""
        if self.stopped:
            return ""
        self.pending += self._decode_new(final=True)
        return self._release(final=True)

    def _decode_new(self, final: bool) -> str:
        """Text of tokens past read_offset, or "" while it still ends in half a character."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        full_text = self._decode(self.prefix_offset, len(self.ids))
        incomplete = full_text.endswith(REPLACEMENT_CHAR) and not final
        if len(full_text) <= len(prefix_text) or incomplete:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full_text[len(prefix_text):]

    def _decode(self, start: int, end: int) -> str:
        return self._decode_ids(self.ids[start:end])

    def _release(self, final: bool) -> str:
        """Cut at the first stop string if one matched, else keep back a possible stop prefix."""
        match = self._first_stop()
        if match is not None:
            cut, self.stopped = match[1] if self.include_stop else match[0], True
            out, self.pending = self.pending[:cut], ""
        else:
            cut = len(self.pending) - (0 if final else self._possible_stop_prefix_len())
            out, self.pending = self.pending[:cut], self.pending[cut:]
            self._early = max(0, self._early - cut)
        return out

    def _first_stop(self) -> tuple[int, int] | None:
        """(start, end) of the stop string that completes earliest in the pending text, past the
        first min_tokens tokens' text."""
        best = None
        for s in self.stop:
            i = self.pending.find(s, max(0, self._early - len(s) + 1))
            if i >= 0 and (best is None or i + len(s) < best[1]):
                best = (i, i + len(s))
        return best

    def _possible_stop_prefix_len(self) -> int:
        """Length of the longest pending suffix that is a proper prefix of some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(s[:n]):
                    longest = n
                    break
        return longest


def window_decoder(tokenizer) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)` (no
    space clean-up: it could join text across window edges differently each step), by the Rust
    tokenizer itself when the class decodes through it unchanged: transformers' wrapper costs ~10 µs
    a call, and every token of every sequence makes two calls. A class with its own decoding (or a
    Python tokenizer) goes through the wrapper."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: the wrapper is always right
        TokenizersBackend = None
    cls = type(tokenizer)
    if (TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend)
            and cls.decode is PreTrainedTokenizerBase.decode and cls._decode is TokenizersBackend._decode):
        return partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=True)
    return partial(tokenizer.decode, skip_special_tokens=True, clean_up_tokenization_spaces=False)
