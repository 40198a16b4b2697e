"""A whole (non-streamed) answer's replies are held and sent together (worker/held.py): the verdict
and first token within KVGATE_FIRST_HOLD_S, the rest merged; fewer messages, the same text, the
same sequence rules, and a takeover that resumes such a request from its log as it would any other.

Real worker processes on a real Redis, fed by XADD as a gateway would: `held` with the defaults,
`slow` with a pause after every step and a short hold (the periodic release), `each` with
KVGATE_HOLD_S=0 (every delta as it comes), `patient` with a first hold longer than any answer here."""
from __future__ import annotations

import pytest

from shared import names, protocol
from tests.integration.test_faults import Cluster
from tests.worker.test_wire_schemas import Channel, entry


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    c = Cluster(tmp_path_factory.mktemp("held"), tiny_model_dir)
    started = {"held": c.spawn_worker("held"),  # side by side, then each waited for
               "slow": c.spawn_worker("slow", "--version", "v2", KVGATE_HOLD_S="0.1", KVGATE_FAULT_STEP_MS="20"),
               "each": c.spawn_worker("each", "--version", "v3", KVGATE_HOLD_S="0"),
               "patient": c.spawn_worker("patient", "--version", "v4", KVGATE_FIRST_HOLD_S="1")}
    for name, proc in started.items():
        c.worker_ready(name, proc)
    yield c
    c.close()


def _send(cluster: Cluster, e: protocol.RequestEntry) -> None:
    cluster.client.xadd(names.request_stream(e.model, e.version), {protocol.ENTRY_FIELD: protocol.encode(e)})


def _run(cluster: Cluster, name: str, version: str = "v1", **fields) -> list[dict]:
    """The replies to a request sent to the worker of `version`."""
    ch = Channel(cluster, name)
    e = entry(name, ch.name, prompt="Hello there", **fields).model_copy(update={"version": version})
    _send(cluster, e)
    return ch.raw_replies(name)


def _texts(replies: list[dict]) -> dict[int, str]:
    out: dict[int, str] = {}
    for r in replies:
        if r["type"] == "delta":
            out[r.get("index", 0)] = out.get(r.get("index", 0), "") + r.get("text", "")
    return out


def _tokens(replies: list[dict]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r in replies:
        if r["type"] == "delta":
            out.setdefault(r.get("index", 0), []).extend(r.get("token_ids", []))
    return out


def test_a_whole_answer_goes_out_merged_with_the_streamed_text(cluster):
    streamed = _run(cluster, "streamed")
    whole = _run(cluster, "whole", streamed=False)
    assert [r["seq"] for r in streamed] == list(range(1, 9))  # verdict, 6 tokens, done
    seqs = [r["seq"] for r in whole]
    assert seqs in ([1, 2, 3], [1, 2, 3, 4])  # verdict, the 6 tokens (first token apart if the
    assert not whole[0].get("token_ids")      # answer outlasted the first hold), done
    assert whole[-2]["finish_reason"] == streamed[-2]["finish_reason"] == "length"
    assert _texts(whole) == _texts(streamed) and _tokens(whole) == _tokens(streamed)
    assert whole[-1]["type"] == "done" and whole[-1]["completion_tokens"] == 6
    # the log holds what was sent, nothing more: a resume reads the same
    logged = cluster.client.lrange(names.checkpoint_key("whole"), 0, -1)
    assert [protocol.decode_reply(raw).seq for raw in logged] == seqs


def test_a_whole_answer_done_within_the_first_hold_is_one_message(cluster):
    """The verdict, every token merged, and done: one pub/sub message, one flush of the worker."""
    ch = Channel(cluster, "patient")
    e = entry("patient", ch.name, prompt="Hello there", streamed=False).model_copy(update={"version": "v4"})
    _send(cluster, e)
    messages = ch.messages()
    assert len(messages) == 1, messages
    [replies] = messages
    assert [r["seq"] for r in replies] == [1, 2, 3]
    assert not replies[0].get("token_ids") and len(replies[1]["token_ids"]) == 6


def test_each_choice_of_a_whole_answer_is_merged_on_its_own(cluster):
    streamed = _run(cluster, "n2-streamed", params={"n": 2})
    whole = _run(cluster, "n2-whole", streamed=False, params={"n": 2})
    assert [r["seq"] for r in whole] == list(range(1, len(whole) + 1))
    assert len(whole) < len(streamed) and len(whole) <= 6  # verdict, first token, ≤ 1 more per choice, done
    assert _tokens(whole) == _tokens(streamed) and set(_tokens(whole)) == {0, 1}
    assert all(len(t) == 6 for t in _tokens(whole).values())
    assert whole[-1]["completion_tokens"] == 12


def test_held_deltas_go_out_every_hold_s_of_a_long_answer(cluster):
    """20 ms a step, 24 tokens, a 0.1 s hold: the answer goes out in a few merged deltas, not 24."""
    whole = _run(cluster, "long", version="v2", streamed=False, params={"max_tokens": 24})
    deltas = [r for r in whole if r["type"] == "delta" and r.get("token_ids")]
    assert 3 <= len(deltas) <= 12, [len(d["token_ids"]) for d in deltas]
    assert len(deltas[0]["token_ids"]) <= 2  # the first token waited one first hold (20 ms) at most
    assert sum(len(d["token_ids"]) for d in deltas) == 24
    assert [r["seq"] for r in whole] == list(range(1, len(whole) + 1))


def test_a_hold_of_zero_sends_every_delta(cluster):
    whole = _run(cluster, "each", version="v3", streamed=False)
    assert [r["seq"] for r in whole] == list(range(1, 9))


def test_a_whole_answer_taken_over_from_its_log_goes_on_held(cluster):
    """Its dead worker logged the verdict and the first token: the survivor sends the rest merged."""
    from tests.worker.test_wire_schemas import orphan

    rid, ch = "whole-resumed", Channel(cluster, "whole-resumed")
    logged = [protocol.Delta(request_id=rid, seq=1),
              protocol.Delta(request_id=rid, seq=2, text="Hi", token_ids=[11])]
    cluster.client.rpush(names.checkpoint_key(rid), *(protocol.encode(r) for r in logged))
    orphan(cluster, protocol.encode(entry(rid, ch.name, prompt_token_ids=[5, 6, 7], streamed=False)))
    replies = ch.raw_replies(rid)
    assert [r["seq"] for r in replies] == [3, 4]  # the 5 tokens left, then done
    assert len(replies[0]["token_ids"]) == 5 and replies[-1]["completion_tokens"] == 6


def test_an_older_worker_never_sees_the_field():
    """Written for a schema-5 peer, the entry loses `streamed` (that peer streams every delta)."""
    e = entry("old", "kvgate:reply:x", prompt="Hi", streamed=False)
    assert b"streamed" not in protocol.encode(e, 5)
    assert protocol.decode_entry(protocol.encode(e)).streamed is False
    assert protocol.decode_entry(protocol.encode(e, 5)).streamed is True
