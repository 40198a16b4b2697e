"""gpt-oss's harmony replies split by channel: the analysis channel's bodies are the reasoning, the
final channel's (and a commentary preamble's) the answer, the headers neither — with the text as the
real detokenizer releases it (late, in pieces), and resumed mid-reply; the structured-output gate
opens where the final channel's body begins."""
from __future__ import annotations

import pytest
from tokenizers import AddedToken

from shared import reasoning
from shared.sampling import StructuredOutputs
from worker.engine.constraint import Constraint, HarmonyGate, think_markers
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.structured import Grammars
from worker.thinking import HarmonyMarkers, Markers
from worker.models.demo import train_tokenizer

TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}{% if m.channel %}<|channel|>{{ m.channel }}{% endif %}"
            "<|message|>{{ m.content }}<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
REPLY = ("<|channel|>analysis<|message|>The user greets; greet back, ünïcödé too.<|end|>"
         "<|start|>assistant<|channel|>commentary<|message|>One moment.<|end|>"
         "<|start|>assistant<|channel|>analysis<|message|> Still thinking.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>Hello — how can I help? 你好<|return|>")
REASONING = "The user greets; greet back, ünïcödé too. Still thinking."
ANSWER = "One moment.Hello — how can I help? 你好"


@pytest.fixture(scope="module")
def tok():
    tokenizer = train_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in reasoning.HARMONY_TOKENS])
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def prompt_of(tok) -> list[int]:
    return encode(tok, tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                               tokenize=False))


def replay(tok, prompt, reply_ids, chunk: int, lag: int = 0, stop=(), resumed_at: int = 0):
    """(reasoning, answer) of the reply fed `chunk` tokens at a time, each piece of text released
    `lag` calls late; from `resumed_at` on, as a choice resumed there (its earlier text sent)."""
    markers = Markers.of(tok, "harmony")
    split = markers.split(prompt, reply_ids[:resumed_at])
    det = IncrementalDetokenizer(tok, prompt + reply_ids[:resumed_at], list(stop), False)
    held, parts = [], ["", ""]
    rest = reply_ids[resumed_at:]
    for i in range(0, len(rest), chunk):
        ids = rest[i:i + chunk]
        held.append(det.add(ids))
        text = held.pop(0) if len(held) > lag else ""
        for j, part in enumerate(split.add(ids, text)):
            parts[j] += part
    for j, part in enumerate(split.add([], "".join(held) + det.flush(), final=True)):
        parts[j] += part
    return tuple(parts)


@pytest.mark.parametrize("chunk", [1, 2, 5, 1000])
@pytest.mark.parametrize("lag", [0, 3])
def test_a_reply_splits_by_channel_however_its_text_comes(tok, chunk, lag):
    prompt, reply = prompt_of(tok), encode(tok, REPLY)
    assert tok.decode(prompt, skip_special_tokens=False).endswith("<|start|>assistant")
    assert replay(tok, prompt, reply, chunk, lag) == (REASONING, ANSWER)
    # a stop string that never matches holds text back at each of its prefixes
    assert replay(tok, prompt, reply, chunk, lag, stop=["Hel!", "ün?"]) == (REASONING, ANSWER)


def test_a_resumed_reply_splits_on_where_it_was(tok):
    """Taken over inside the commentary message's header: the rest splits as it would have."""
    prompt, reply = prompt_of(tok), encode(tok, REPLY)
    start = encode(tok, "<|start|>")[0]
    cut = reply.index(start) + 2  # <|start|> and "assistant" of the second message sent already
    assert replay(tok, prompt, reply, 1, resumed_at=cut) == (" Still thinking.", ANSWER)


def test_a_prompt_without_a_started_message_is_answered_as_text(tok):
    """A completion-style prompt (no <|start|>): nothing is a header, everything is the answer."""
    assert replay(tok, encode(tok, "Hi"), encode(tok, "plain words"), 2) == ("", "plain words")


def test_the_parser_comes_from_the_template_and_needs_its_tokens(tok):
    assert reasoning.detect(TEMPLATE) == reasoning.HARMONY
    assert reasoning.detect("{{ '<think>' }}") == "qwen3" and reasoning.detect("plain") is None
    assert isinstance(Markers.of(tok, "harmony"), HarmonyMarkers)
    assert HarmonyMarkers.of(train_tokenizer()) is None  # no such tokens: no parser
    with pytest.raises(ValueError, match="harmony"):
        think_markers("harmony", train_tokenizer())  # configured, not tokens: refuse to start


def test_the_gate_opens_where_the_final_channels_body_begins(tok):
    grammars = Grammars(tok, len(tok), [encode(tok, "<|return|>")[0]], max_spec_bytes=1 << 16)
    grammar = grammars.submit(StructuredOutputs(regex="[0-9]+")).result()
    gate = think_markers(None, tok)
    assert isinstance(gate, HarmonyGate)
    constraint = Constraint(grammar, prompt_of(tok), gate)
    reply = encode(tok, REPLY.split("final<|message|>")[0] + "final<|message|>")
    for token in reply:
        assert not constraint.active and constraint.accept(token)  # free through analysis and commentary
    assert constraint.active  # the answer is constrained
    assert not constraint.accept(encode(tok, "x")[0])  # and the grammar refuses a letter there
    assert Constraint(grammar, encode(tok, "Hi"), gate).active  # no message begun: the answer at once
    opened = prompt_of(tok) + encode(tok, "<|channel|>final<|message|>")
    assert Constraint(grammar, opened, gate).active  # the template opened the final channel itself


def test_a_model_that_writes_no_harmony_is_answered_as_text(tok):
    """Past MAX_HEADER tokens without <|message|>, the "header" was none: the reply, from its first
    token, is the answer's text (not dropped), and a constraint applies from there."""
    words = " ".join(f"w{i}" for i in range(80))
    reply = encode(tok, words)
    assert len(reply) > reasoning.MAX_HEADER
    for chunk, lag in ((1, 0), (7, 2), (1000, 0)):
        assert replay(tok, prompt_of(tok), reply, chunk, lag) == ("", words)
    grammars = Grammars(tok, len(tok), [encode(tok, "<|return|>")[0]], max_spec_bytes=1 << 16)
    constraint = Constraint(grammars.submit(StructuredOutputs(regex="[a-z0-9 ]+")).result(), prompt_of(tok),
                            think_markers(None, tok))
    opens = reasoning.MAX_HEADER - len(encode(tok, "assistant"))  # the prompt began the header: its role
    for token in reply[:opens]:
        assert constraint.accept(token) and not constraint.active
    assert constraint.accept(reply[opens]) and constraint.active


@pytest.mark.parametrize("header", [
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>",  # the recipient first
])
@pytest.mark.parametrize("chunk, lag", [(1, 0), (3, 2), (1000, 0)])
def test_a_tool_call_reaches_the_gateway_as_the_hermes_parser_reads_one(tok, header, chunk, lag):
    from shared import tool_parsers

    reply = encode(tok, "<|channel|>analysis<|message|>Need the weather.<|end|>" + header
                   + '{"city": "Oslo", "note": "ü"}<|call|>')
    thinking, answer = replay(tok, prompt_of(tok), reply, chunk, lag)
    assert thinking == "Need the weather."
    assert answer == '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "note": "ü"}}</tool_call>'
    content, calls = tool_parsers.parse("hermes", answer)
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo", "note": "ü"}')]


def test_the_worker_reads_a_harmony_models_tool_calls_with_the_hermes_parser(tok):
    from shared.settings import WorkerSettings
    from worker.main import resolve_parsers

    resolved = resolve_parsers(WorkerSettings(model="m"), tok)
    assert (resolved.reasoning_parser, resolved.tool_call_parser) == ("harmony", "hermes")
