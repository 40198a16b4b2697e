"""A worker whose model thinks: its chats' thinking goes out as each delta's `reasoning`, the answer
as its `text`, the markers in neither; the registry says which parsers it resolved; a takeover in
the middle of the thinking splits the rest exactly as the uninterrupted run did.

The model is the demo one with a thinking template, its `</think>` row of the output layer made a
copy (scaled up) of a token its greedy output reaches after a few tokens, so it ends its thinking
there: random weights alone would almost never write `</think>`."""
from __future__ import annotations

import orjson
import pytest

from shared import names, protocol, reasoning
from tests.conftest import TINY, wire_entry
from tests.integration.test_faults import Cluster
from tests.worker.test_wire_schemas import Channel, orphan, xadd

CHAT = [{"role": "user", "content": "Why is the sky blue?"}]
MAX_TOKENS = 24


def greedy(model_dir, messages=CHAT, n=MAX_TOKENS) -> tuple[list[int], list[int]]:
    """(prompt, output) ids of the paged engine in this process, greedy."""
    from worker.engine.engine import LLMEngine
    from worker.engine.tokenizer import render_chat
    from worker.engine.types import SamplingParams

    engine = LLMEngine.from_model_dir(model_dir, device="cpu")
    prompt = render_chat(engine.tokenizer, messages)
    engine.add_request("r", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
    return prompt, out


@pytest.fixture(scope="module")
def thinking_model_dir(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from worker.models.demo import build_model_dir
    from worker.thinking import Markers
    from worker.engine.tokenizer import load_tokenizer

    path = build_model_dir(tmp_path_factory.mktemp("thinking"), thinking=True, **TINY)
    end_id = Markers.of(load_tokenizer(path), "qwen3").end_id
    _, out = greedy(path)
    original = load_file(path / "model.safetensors")
    for at in [i for i in range(3, len(out) - 4) if out[i] not in out[:i]]:
        weights = {**original, "lm_head.weight": original["lm_head.weight"].clone()}
        weights["lm_head.weight"][end_id] = 1.05 * weights["lm_head.weight"][out[at]]
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
        _, thinks = greedy(path)
        if end_id in thinks[3:-3] and end_id not in thinks[:3]:
            return path
    raise AssertionError(f"no token of {out} made the model end its thinking mid-way")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, thinking_model_dir):
    c = Cluster(tmp_path_factory.mktemp("think"), thinking_model_dir)
    c.start_worker("wt")
    yield c
    c.close()


def chat_entry(request_id: str, channel: str, **fields) -> protocol.RequestEntry:
    return wire_entry(request_id, channel, max_tokens=MAX_TOKENS).model_copy(
        update={"kind": "chat", "messages": CHAT, **fields})


def deltas(replies: list[dict]) -> list[dict]:
    assert replies[-1]["type"] == "done", replies[-1]
    return [r for r in replies[1:] if r["type"] == "delta"]  # after the admission verdict


def test_the_registry_carries_the_parsers_resolved_from_the_template(cluster):
    info = cluster.info("wt")
    assert (info["reasoning_parser"], info["tool_call_parser"]) == ("qwen3", "hermes")
    lines = [orjson.loads(raw) for raw in (cluster.root / "wt.log").read_bytes().splitlines()
             if raw.startswith(b"{") and b"serving demo:v1" in raw]
    assert lines and "(reasoning parser qwen3, tool call parser hermes)" in lines[0]["msg"]
    assert (lines[0]["reasoning_parser"], lines[0]["tool_call_parser"]) == ("qwen3", "hermes")


def test_thinking_goes_to_reasoning_then_the_answer_to_text(cluster, thinking_model_dir):
    from worker.engine.tokenizer import load_tokenizer
    from worker.thinking import Markers

    tok = load_tokenizer(thinking_model_dir)
    m = Markers.of(tok, "qwen3")
    ch = Channel(cluster, "think")
    xadd(cluster, protocol.encode(chat_entry("think", ch.name)))
    got = deltas(ch.raw_replies("think"))
    ids = [t for d in got for t in d["token_ids"]]
    assert m.end_id in ids[1:-1], f"the model did not end its thinking inside the output: {ids}"
    prompt, _ = greedy(thinking_model_dir)
    thought = [t for i, t in enumerate(ids) if m.thinking(prompt + ids[:i + 1]) and t != m.start_id]
    answer = [t for i, t in enumerate(ids) if not m.thinking(prompt + ids[:i + 1]) and t != m.end_id]
    reasoning_text = "".join(d.get("reasoning") or "" for d in got)
    text = "".join(d["text"] for d in got)
    print(f"\n[reasoning split] {len(thought)} thinking tokens {reasoning_text!r}, then "
          f"{len(answer)} answer tokens {text!r}")
    assert reasoning_text == tok.decode(thought) and reasoning_text
    assert text == tok.decode(answer) and text
    last_thought = max(i for i, d in enumerate(got) if d.get("reasoning"))
    first_answer = min(i for i, d in enumerate(got) if d["text"])
    assert last_thought < first_answer, "all the thinking, then the answer"
    for piece in [reasoning_text, text]:
        assert "<think>" not in piece and "</think>" not in piece


def test_thinking_turned_off_by_the_request_is_all_answer(cluster):
    ch = Channel(cluster, "nothink")
    xadd(cluster, protocol.encode(chat_entry("nothink", ch.name,
                                             chat_template_kwargs={"enable_thinking": False})))
    got = deltas(ch.raw_replies("nothink"))
    assert not any(d.get("reasoning") for d in got) and "".join(d["text"] for d in got)
    assert "think>" not in "".join(d["text"] for d in got)


def test_a_takeover_mid_thinking_splits_the_rest_as_the_uninterrupted_run(cluster, thinking_model_dir):
    ch = Channel(cluster, "resume")
    xadd(cluster, protocol.encode(chat_entry("whole", ch.name)))
    whole = ch.raw_replies("whole")
    split_at = 3  # the verdict and two deltas, all thinking, were sent before the worker died
    assert all(r.get("reasoning") and not r["text"] for r in whole[1:split_at]), whole[:split_at]
    for reply in whole[:split_at]:
        cluster.client.rpush(names.checkpoint_key("taken"), orjson.dumps({**reply, "request_id": "taken"}))
    orphan(cluster, protocol.encode(chat_entry("taken", ch.name)))
    taken = ch.raw_replies("taken")
    assert taken[0]["seq"] == split_at + 1
    assert [{**r, "request_id": "whole"} for r in taken] == whole[split_at:]
    assert any(r.get("text") for r in taken) and any(r.get("reasoning") for r in taken)
