"""What one token is, for logprobs on the wire: the text it shows as and the bytes it really is.

A token holding part of a UTF-8 character decodes alone to U+FFFD, so its text cannot give its
bytes (the client needs them to join such tokens back into the character); the vocabulary's own
piece can: GPT-2's byte alphabet in byte-level vocabularies (Llama 3, Qwen), `<0xNN>` in
SentencePiece's byte fallback (Llama 2, Mistral). Anything else is its text's bytes.
"""
from __future__ import annotations

import functools
import json
import re

CACHE = 1 << 16  # tokens remembered: the ones a model keeps proposing are few
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character → byte: printable bytes stand for themselves, the
    others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return {c: b for b, c in chars.items()}


def _decoder_types(tokenizer) -> set[str]:
    """The types of the fast tokenizer's decoder (a Sequence: of its members); none for a slow one."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return set()
    state = json.loads(decoder.__getstate__())
    return {state["type"], *(d.get("type") for d in state.get("decoders", ()))}


class TokenText:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.alphabet = _byte_alphabet() if "ByteLevel" in _decoder_types(tokenizer) else None
        self.of = functools.lru_cache(maxsize=CACHE)(self._of)

    def _of(self, token_id: int) -> tuple[str, list[int]]:
        """(text, bytes): the text as the output shows it (a special token shows as nothing), the
        bytes from the vocabulary's piece where they are what the text shows, else the text's."""
        text = self.tokenizer.decode([token_id], skip_special_tokens=True)
        raw = self._piece_bytes(self.tokenizer.convert_ids_to_tokens(token_id))
        if raw is not None and bytes(raw).decode(errors="replace") == text:
            return text, raw
        return text, list(text.encode())

    def _piece_bytes(self, piece) -> list[int] | None:
        if not isinstance(piece, str):
            return None
        if self.alphabet is not None and all(c in self.alphabet for c in piece):
            return [self.alphabet[c] for c in piece]
        if match := _BYTE_PIECE.fullmatch(piece):
            return [int(match.group(1), 16)]
        return None
