"""Tokenizer helpers on a demo tokenizer folder: EOS ids from every file, chat rendering."""
import json

import pytest

from worker.engine.tokenizer import encode_prompt, eos_token_ids, load_tokenizer, render_chat
from worker.models.demo import train_tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    train_tokenizer().save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": [2, 7]}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    return path


def test_eos_ids_are_the_union_of_tokenizer_config_and_generation_config(folder):
    tok = load_tokenizer(folder)
    assert eos_token_ids(folder, tok) == {tok.eos_token_id, 2, 7, 9}


def test_render_chat_ends_with_the_assistant_turn(folder):
    tok = load_tokenizer(folder)
    ids = render_chat(tok, [{"role": "user", "content": "héllo 你好"}])
    assert tok.decode(ids) == "<|im_start|>user\nhéllo 你好<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(encode_prompt(tok, "héllo 你好")) == "héllo 你好"


def test_render_chat_without_a_template_says_so(folder):
    tok = load_tokenizer(folder)
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        render_chat(tok, [{"role": "user", "content": "hi"}])
