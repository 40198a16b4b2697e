"""The admission verdict: a worker that starts a request first sends it an empty delta (seq 1), so a
gateway may hold a stream's 200 until it knows the request was admitted; a refusal is the first
reply instead. A takeover sends a verdict only when its request's log holds none, so no sequence
number is used twice or skipped. A stream's verdict goes out ahead of a step that takes longer than
a round trip to Redis.

Real worker processes on a real Redis, fed by XADD as a gateway would: `w1`, and `slow` (v2), whose
every step is 50 ms longer (a slow device), so its steps outlast any round trip on any machine."""
from __future__ import annotations

import pytest

from shared import names, protocol
from tests.integration.test_faults import Cluster
from tests.worker.test_wire_schemas import Channel, entry, orphan, xadd


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    c = Cluster(tmp_path_factory.mktemp("verdict"), tiny_model_dir)
    started = {"w1": c.spawn_worker("w1"),  # side by side, then each waited for
               "slow": c.spawn_worker("slow", "--version", "v2", KVGATE_FAULT_STEP_MS="50")}
    for name, proc in started.items():
        c.worker_ready(name, proc)
    yield c
    c.close()


def _is_verdict(reply: dict) -> bool:
    return reply["type"] == "delta" and not (reply.get("text") or reply.get("token_ids")
                                             or reply.get("finish_reason"))


def test_an_admitted_request_gets_the_verdict_first(cluster):
    ch = Channel(cluster, "fresh")
    xadd(cluster, protocol.encode(entry("fresh", ch.name, prompt="Hello there")))
    replies = ch.raw_replies("fresh")
    assert [r["seq"] for r in replies] == list(range(1, 9))  # verdict, 6 tokens, done
    assert _is_verdict(replies[0]) and not any(_is_verdict(r) for r in replies[1:])
    assert replies[-1]["type"] == "done" and replies[-1]["completion_tokens"] == 6


def test_a_streams_verdict_goes_out_before_a_long_step(cluster):
    """Published alone, before the engine steps: the gateway sends the stream's 200 while the prompt
    is prefilled, instead of after it together with the first token."""
    for rid in ("early", "early-again"):  # its first request, and one after it has timed its steps
        ch = Channel(cluster, rid)
        e = entry(rid, ch.name, prompt="Hello there").model_copy(update={"version": "v2"})
        cluster.client.xadd(names.request_stream("demo", "v2"), {protocol.ENTRY_FIELD: protocol.encode(e)})
        messages = ch.messages()
        assert len(messages[0]) == 1 and _is_verdict(messages[0][0]), messages[0]
        assert [r["seq"] for m in messages for r in m] == list(range(1, 9))


def test_a_refused_request_gets_only_its_error(cluster):
    ch = Channel(cluster, "refused")
    xadd(cluster, protocol.encode(entry("refused", ch.name, prompt_token_ids=[5, 6],
                                        params={"max_tokens": 4096})))
    [error] = ch.raw_replies("refused")
    assert error["type"] == "error" and error["seq"] == 1
    assert error["code"] == "context_length_exceeded"


def test_a_takeover_after_the_verdict_sends_none_and_goes_on_from_the_log(cluster):
    ch = Channel(cluster, "resumed")
    rid = "resumed"
    logged = [protocol.Delta(request_id=rid, seq=1),
              protocol.Delta(request_id=rid, seq=2, text="Hi", token_ids=[11])]
    cluster.client.rpush(names.checkpoint_key(rid), *(protocol.encode(r) for r in logged))
    orphan(cluster, protocol.encode(entry(rid, ch.name, prompt_token_ids=[5, 6, 7])))
    replies = ch.raw_replies(rid)
    assert [r["seq"] for r in replies] == list(range(3, 9))  # 5 more tokens, then done
    assert not any(_is_verdict(r) for r in replies)
    assert replies[-1]["completion_tokens"] == 6


def test_a_takeover_before_any_reply_sends_the_verdict(cluster):
    ch = Channel(cluster, "unanswered")
    orphan(cluster, protocol.encode(entry("unanswered", ch.name, prompt_token_ids=[5, 6, 7])))
    replies = ch.raw_replies("unanswered")
    assert [r["seq"] for r in replies] == list(range(1, 9)) and _is_verdict(replies[0])
