"""Each token's text and real bytes, for logprobs: tokens that hold part of a UTF-8 character show
as U+FFFD but keep their own bytes, in byte-level and in SentencePiece byte-fallback vocabularies."""
from __future__ import annotations

from worker.engine.tokenizer import load_tokenizer
from worker.token_text import TokenText


def test_byte_level_tokens_keep_their_bytes(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    of = TokenText(tokenizer).of
    partial = {}
    for token_id in range(len(tokenizer)):
        text, raw = of(token_id)
        assert bytes(raw).decode(errors="replace") == text, (token_id, text, raw)
        if "\ufffd" in text:
            partial[token_id] = bytes(raw)
    assert len(partial) > 100 and len(set(partial.values())) == len(partial), "bytes must differ"
    ids = tokenizer.encode("naïve €", add_special_tokens=False)
    assert b"".join(bytes(of(i)[1]) for i in ids) == "naïve €".encode()
    assert of(tokenizer.eos_token_id) == ("", [])  # a special token is not text


def test_byte_fallback_pieces_are_their_byte():
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)},
             "▁": 259, "h": 260, "i": 261, "▁h": 262}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "h")], byte_fallback=True,
                                   unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")
    of = TokenText(tokenizer).of
    ids = tokenizer.encode("hi é", add_special_tokens=False)
    assert [of(i) for i in ids][-2:] == [("\ufffd", [0xC3]), ("\ufffd", [0xA9])]
    assert of(260) == ("h", [104])
