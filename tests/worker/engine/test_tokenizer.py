"""Tokenizer helpers on a demo tokenizer folder: EOS ids from every file, chat rendering."""
import json

import pytest

from worker.engine.tokenizer import encode_prompt, eos_token_ids, load_tokenizer, render_chat
from worker.engine.types import EngineRejected
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


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_the_demo_markers_are_single_tokens_kept_in_text_and_the_vocabulary_is_unchanged(folder):
    from worker.engine.tokenizer import marker_ids

    tok = load_tokenizer(folder)
    ids = marker_ids(tok, ("<think>", "</think>", "<tool_call>", "</tool_call>"))
    assert ids == [2044, 2045, 2046, 2047] and len(tok) == 2048
    assert tok.decode(ids, skip_special_tokens=True) == "<think></think><tool_call></tool_call>"
    assert marker_ids(tok, ("<think>", "<nothink>")) is None


def test_tools_are_listed_in_the_system_turn(folder):
    tok = load_tokenizer(folder)
    text = tok.decode(render_chat(tok, [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Weather in Paris?"}], tools=TOOLS))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert "</tools>" in text and text.count("<|im_start|>system") == 1
    assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_a_tool_call_round_trip_renders_arguments_as_json_and_results_in_a_user_turn(folder):
    tok = load_tokenizer(folder)
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    ]
    text = tok.decode(render_chat(tok, messages, tools=TOOLS))
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
            '</tool_call><|im_end|>\n') in text, "arguments as an object, not a JSON string in a string"
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}', "not mutated"


@pytest.mark.parametrize("arguments, says", [
    ("{city: Paris", r"messages\[1\].tool_calls\[0\].function.arguments is not JSON"),
    ("[" * 3000 + "]" * 3000, r"function.arguments is not JSON: maximum recursion depth"),
    ('{"a": "\\ud800"}', "the rendered messages cannot be encoded"),  # a lone surrogate reaches the tokenizer
])
def test_tool_call_arguments_the_worker_cannot_render_are_the_requests_error(folder, arguments, says):
    """Refused by the gateway first (tests/gateway/test_bounds.py); here, for entries that did not
    come through it, the worker's refusal is the request's (a 400), not a failure of its own."""
    tok = load_tokenizer(folder)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    with pytest.raises(EngineRejected, match=says) as caught:
        render_chat(tok, [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": None, "tool_calls": [call]}])
    assert caught.value.code == "invalid_request" and caught.value.param == "messages"


def test_enable_thinking_opens_a_think_block_and_reserved_kwargs_never_override_ours(folder):
    tok = load_tokenizer(folder)
    chat = [{"role": "user", "content": "hi"}]
    plain = tok.decode(render_chat(tok, chat))
    assert plain.endswith("<|im_start|>assistant\n"), "thinking is off unless asked for"
    thinking = tok.decode(render_chat(tok, chat, chat_template_kwargs={"enable_thinking": True}))
    assert thinking == plain + "<think>\n"
    hostile = {"add_generation_prompt": False, "tokenize": True, "messages": [], "tools": TOOLS,
               "chat_template": "{{ 'pwned' }}", "return_dict": True}
    assert render_chat(tok, chat, chat_template_kwargs=hostile) == render_chat(tok, chat)


def test_a_thinking_demo_template_thinks_unless_told_not_to():
    tok = train_tokenizer(thinking=True)
    chat = [{"role": "user", "content": "hi"}]
    assert tok.decode(render_chat(tok, chat)).endswith("<|im_start|>assistant\n<think>\n")
    off = render_chat(tok, chat, chat_template_kwargs={"enable_thinking": False})
    assert tok.decode(off).endswith("<|im_start|>assistant\n")
