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


def _stream(parser: tp.ToolParser, text: str, size: int = 4) -> list[tp.Event]:
    events = []
    for i in range(0, len(text), size):
        events += parser.feed(text[i:i + size])
    return events + parser.finish()


@pytest.mark.parametrize("name, opening", [("hermes", "<tool_call>"), ("llama3", "")])
def test_a_header_that_never_completes_is_parsed_a_bounded_number_of_times(monkeypatch, name, opening):
    """A model made to write `<tool_call>` and then whitespace (or a name that never ends) would have
    its header parsed again from the start for every piece, on the gateway's event loop: quadratic in
    the output. Past HEADER_MAX characters the block is judged whole instead."""
    parsed = []
    original = tp.header
    monkeypatch.setattr(tp, "header", lambda text, keys: parsed.append(len(text)) or original(text, keys))
    for tail in (" " * 40_000, '{"name": "' + "x" * 40_000):
        parsed.clear()
        content, calls = tp.collect(_stream(tp.make(name), opening + tail))
        assert (content, calls) == (opening + tail, [])  # what never became a call, given back whole
        assert sum(parsed) <= 2 * tp.HEADER_MAX * (tp.HEADER_MAX // 4 + 1)


def test_a_long_header_still_makes_a_call_judged_whole():
    text = "<tool_call>" + "\n" * (2 * tp.HEADER_MAX) + '{"name": "f", "arguments": {"a": 1}}</tool_call>'
    content, calls = tp.collect(_stream(tp.make("hermes"), text))
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]
    llama = " " * (2 * tp.HEADER_MAX) + '{"name": "g", "parameters": {"b": 2}}'
    content, calls = tp.collect(_stream(tp.make("llama3"), llama))
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("g", {"b": 2})]


def test_an_unclosed_block_is_set_aside_not_searched_again():
    """While a block waits for its `</tool_call>` (judged whole, or the text after a call's
    arguments), what has been searched is moved out of the buffer that each piece searches."""
    parser = tp.make("hermes")
    for piece in ['<tool_call>{"other": "', *["xyz"] * 5000]:
        parser.feed(piece)
        assert len(parser.buf) < 40
    assert parser.feed('"}</tool_call>') == [tp.Content('<tool_call>{"other": "' + "xyz" * 5000 + '"}</tool_call>')]
    tail = tp.make("hermes")
    tail.feed('<tool_call>{"name": "f", "arguments": {}}')
    for _ in range(5000):
        tail.feed(" junk")
        assert len(tail.buf) < len(tp.HermesParser.END)
    assert tail.feed("</tool_call>done") == [tp.Content("done")]


@pytest.mark.parametrize("name, text", [
    ("hermes", "<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>"),
    ("hermes", '<tool_call>{"name": "f", "arguments": "' + "[" * 5000 + '"}</tool_call>'),
    ("llama3", '{"name": "f", "parameters": ' + "[" * 5000),
    ("llama3", "[" * 5000 + "]" * 5000),
])
def test_json_nested_deeper_than_python_decodes_is_text_not_an_error(name, text):
    content, calls = tp.parse(name, text)
    assert calls == [] and content == text
