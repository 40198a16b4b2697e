"""The tool-call parsers on recorded model outputs (well-formed and malformed), fed whole and fed
piece by piece: streaming must add up to exactly what the whole text gives, and text that only
looked like the start of a call must come back as content."""
from __future__ import annotations

import json

import pytest

from shared import tool_parsers as tp

HERMES = [  # (output as a Qwen/Hermes model wrote it, expected content, expected [(name, arguments)])
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"q": "}{ </tool_call> \\" x"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
     "Let me check.\n", [("a", {"q": '}{ </tool_call> " x'}), ("b", {})]),
    ('<tool_call>{"arguments": {"n": [1, 2]}, "name": "later_name"}</tool_call>', "",
     [("later_name", {"n": [1, 2]})]),  # key order the streaming fast path does not cover
    ('<tool_call>{"name": "s", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [("s", {"x": 1})]),
    ("The answer is 4. I used <tool (a tool) and <b>bold</b>.",
     "The answer is 4. I used <tool (a tool) and <b>bold</b>.", []),
    ("<tool_call>{not json at all}</tool_call> sorry", "<tool_call>{not json at all}</tool_call> sorry", []),
    ('<tool_call>{"name": 5, "arguments": {}}</tool_call>', '<tool_call>{"name": 5, "arguments": {}}</tool_call>', []),
    ("<tool_call>{\"name\": \"cut", "<tool_call>{\"name\": \"cut", []),  # max_tokens inside the header
    ("ends with <tool_ca", "ends with <tool_ca", []),
]

LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [("get_weather", {"city": "Oslo"})]),
    ('<|python_tag|>{"name": "a", "parameters": {"s": "x; y"}}; {"name": "b", "parameters": {}}', "",
     [("a", {"s": "x; y"}), ("b", {})]),
    ('  {"name": "c", "arguments": {"k": {"deep": [1, {"z": "}"}]}}}', "", [("c", {"k": {"deep": [1, {"z": "}"}]}})]),
    ('{"parameters": {"a": 1}, "name": "reordered"}', "", [("reordered", {"a": 1})]),
    ('{"title": "not a call", "year": 1999}', '{"title": "not a call", "year": 1999}', []),
    ("Hello! {\"name\": \"x\", \"parameters\": {}}", "Hello! {\"name\": \"x\", \"parameters\": {}}", []),
    ('{"name": "broken", "parameters": {"a": 1}', "", [("broken", {"a": 1})]),  # cut: arguments as written
    ("<|python", "<|python", []),
]


def _streamed(name: str, text: str, size: int) -> tuple[str, list[tp.ParsedCall]]:
    parser, events = tp.make(name), []
    for i in range(0, len(text), size):
        events += parser.feed(text[i:i + size])
    return tp.collect(events + parser.finish())


def _calls(calls: list[tp.ParsedCall]) -> list[tuple[str, object]]:
    out = []
    for call in calls:
        try:
            out.append((call.name, json.loads(call.arguments)))
        except ValueError:
            out.append((call.name, call.arguments))
    return out


@pytest.mark.parametrize("name, cases", [("hermes", HERMES), ("llama3", LLAMA3)])
def test_recorded_outputs_parse_whole_and_streamed_alike(name, cases):
    for text, content, calls in cases:
        whole = tp.parse(name, text)
        if text.endswith('{"a": 1}'):  # a cut call keeps its arguments as far as they went
            assert whole[1][0].name == "broken" and whole[1][0].arguments == '{"a": 1}'
        else:
            assert (whole[0], _calls(whole[1])) == (content, calls), text
        for size in (1, 3, 7):
            assert _streamed(name, text, size) == whole, (text, size)


def test_a_call_streams_its_name_first_then_its_arguments_in_pieces():
    parser = tp.make("hermes")
    events = []
    for piece in ["Sure", " <tool", "_call>", '{"name": "f', '", "arguments": {"a"', ": 1", "}}", "</tool_call>"]:
        events.append(parser.feed(piece))
    assert events[0] == [tp.Content("Sure")]
    assert events[1] == [tp.Content(" ")]  # "<tool" is held back: it may start a call
    assert events[2] == [] and events[3] == []
    assert events[4] == [tp.CallStart(0, "f"), tp.CallArguments(0, '{"a"')]
    assert events[5] == [tp.CallArguments(0, ": 1")] and events[6] == [tp.CallArguments(0, "}")]
    assert events[7] == [] and parser.finish() == []


def test_held_back_text_is_released_when_it_is_not_a_call():
    parser = tp.make("hermes")
    assert parser.feed("a <tool_") == [tp.Content("a ")]
    assert parser.feed("box> b") == [tp.Content("<tool_box> b")]
    llama = tp.make("llama3")
    assert llama.feed("<|py") == []
    assert llama.feed("thon is nice") == [tp.Content("<|python is nice")]


def test_the_registry_names_every_parser_and_detects_templates():
    assert set(tp.PARSERS) == set(tp.NAMES)
    assert tp.detect("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert tp.detect("<|python_tag|>") == "llama3" and tp.detect("plain") is None
