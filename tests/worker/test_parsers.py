"""The worker resolves its reasoning and tool-call parsers at start-up: from the chat template when
none is named, as given when one is; a name it does not implement stops it with what to choose."""
from __future__ import annotations

import pytest

from shared.settings import WorkerSettings
from worker.main import resolve_parsers
from worker.models.demo import train_tokenizer

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = "{{ '<|start_header_id|>ipython<|end_header_id|>' }}{{ '<|python_tag|>' }}"


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def resolved(tokenizer, template=None, **names) -> tuple[str | None, str | None]:
    original = tokenizer.chat_template
    tokenizer.chat_template = template or original
    try:
        s = resolve_parsers(WorkerSettings(model="/m", **names), tokenizer)
    finally:
        tokenizer.chat_template = original
    return s.reasoning_parser, s.tool_call_parser


def test_none_is_detected_from_the_chat_template(tokenizer):
    assert resolved(tokenizer) == ("qwen3", "hermes")  # the demo's: <think> and <tool_call>
    assert resolved(tokenizer, CHATML) == (None, None)
    assert resolved(tokenizer, LLAMA3) == (None, "llama3")
    assert resolved(tokenizer, {"default": CHATML, "tool_use": "<tool_call>"}) == (None, "hermes")


def test_a_named_parser_is_taken_as_given(tokenizer):
    assert resolved(tokenizer, CHATML, reasoning_parser="deepseek_r1", tool_call_parser="llama3") == \
        ("deepseek_r1", "llama3")


@pytest.mark.parametrize("names, words", [
    ({"reasoning_parser": "granite"},
     "unknown --reasoning-parser 'granite'; choose one of qwen3, deepseek_r1, harmony"),
    ({"tool_call_parser": "mistral"}, "unknown --tool-call-parser 'mistral'; choose one of hermes, llama3"),
])
def test_an_unknown_name_is_refused_with_the_choices(tokenizer, names, words):
    with pytest.raises(ValueError) as caught:
        resolved(tokenizer, **names)
    assert str(caught.value) == words


def test_reasoning_markers_must_be_single_tokens():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"<": 0, "think": 1, ">": 2, "/": 3, "[UNK]": 4}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    plain = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    plain.chat_template = "{{ '<think>' }}"
    with pytest.raises(ValueError, match="<think> and </think> are not single tokens"):
        resolve_parsers(WorkerSettings(model="/m", reasoning_parser="qwen3"), plain)
    detected = resolve_parsers(WorkerSettings(model="/m"), plain)
    assert detected.reasoning_parser is None, "detected but unusable: the worker runs without one"
