"""A worker of this release and what reaches it over Redis: entries of the previous schema are
answered in that schema; an entry it cannot read is answered on its reply channel, never dropped;
a checkpoint log it cannot fully read (another version's lines, or truncated at its cap) makes the
takeover answer resume_failed instead of crashing or resuming from a wrong place.

One real worker process on a real Redis, fed by XADD as a gateway of either release would."""
from __future__ import annotations

import time

import orjson
import pytest

from shared import names, protocol
from tests.conftest import wire_entry
from tests.integration.test_faults import Cluster
from worker import checkpoint

STREAM = names.request_stream("demo", "v1")
CAP = 4096  # the worker's KVGATE_MAX_CHECKPOINT_BYTES here: ~30 deltas
V1_FIELDS = {  # what a schema-1 peer knows of each reply (ADDED lists what later versions added)
    kind: set(cls.model_fields) - set().union(*(a.get(kind, ()) for a in protocol.ADDED.values()))
    for kind, cls in (("delta", protocol.Delta), ("done", protocol.Done), ("error", protocol.ErrorReply))
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    c = Cluster(tmp_path_factory.mktemp("wire"), tiny_model_dir)
    c.start_worker("w1", KVGATE_MAX_CHECKPOINT_BYTES=str(CAP))
    yield c
    c.close()


class Channel:
    def __init__(self, cluster: Cluster, name: str):
        self.pubsub = cluster.client.pubsub()
        self.name = f"kvgate:reply:{name}"
        self.pubsub.subscribe(self.name)
        assert self.pubsub.get_message(timeout=5)["type"] == "subscribe"
        self.got: dict[str, list[dict]] = {}  # request id -> its replies so far, as JSON

    def raw_replies(self, request_id: str, timeout: float = 20) -> list[dict]:
        """Every reply (as JSON) of `request_id` up to its done or error."""
        deadline = time.monotonic() + timeout
        while not self.got.get(request_id) or self.got[request_id][-1]["type"] == "delta":
            assert time.monotonic() < deadline, f"no end for {request_id}: {self.got}"
            message = self.pubsub.get_message(timeout=0.5)
            if message and message["type"] == "message":
                items = orjson.loads(message["data"])
                for item in items if isinstance(items, list) else [items]:
                    self.got.setdefault(item.get("request_id"), []).append(item)
        return self.got[request_id]

    def messages(self, timeout: float = 20) -> list[list[dict]]:
        """Each pub/sub message (its replies, as JSON) up to the one that ends with a done."""
        messages: list[list[dict]] = []
        while not messages or messages[-1][-1]["type"] != "done":
            message = self.pubsub.get_message(timeout=timeout)
            assert message is not None, messages
            if message["type"] == "message":
                items = orjson.loads(message["data"])
                messages.append(items if isinstance(items, list) else [items])
        return messages


def entry(request_id: str, channel: str, **fields) -> protocol.RequestEntry:
    return wire_entry(request_id, channel, max_tokens=6, **fields)


def xadd(cluster: Cluster, raw: bytes) -> None:
    cluster.client.xadd(STREAM, {protocol.ENTRY_FIELD: raw})


def orphan(cluster: Cluster, raw: bytes, delivered: int = 1) -> None:
    """Pending under a worker that is gone, idle long past the heartbeat TTL: the next claim takes it.
    `delivered`: how many times workers were handed it. Made while nothing else waits in the stream."""
    with cluster.client.pipeline(transaction=True) as tx:
        tx.xadd(STREAM, {protocol.ENTRY_FIELD: raw})
        tx.xreadgroup(names.CONSUMER_GROUP, "gone", {STREAM: ">"}, count=1)
        entry_id, read = tx.execute()
    assert read
    assert read[0][1][0][0] == entry_id, "another entry was waiting: it was read instead"
    cluster.client.xclaim(STREAM, names.CONSUMER_GROUP, "gone", min_idle_time=0, message_ids=[entry_id],
                          idle=60_000, retrycount=delivered, justid=True)


def test_a_schema_1_entry_is_answered_in_schema_1(cluster):
    ch = Channel(cluster, "v1-peer")
    xadd(cluster, protocol.encode(entry("old-ok", ch.name, prompt="Hello there"), version=1))
    xadd(cluster, protocol.encode(entry("old-bad", ch.name, prompt_token_ids=[1, 99999]), version=1))
    ok, bad = ch.raw_replies("old-ok"), ch.raw_replies("old-bad")
    assert [r["type"] for r in ok] == ["delta"] * 7 + ["done"]  # the admission verdict, 6 tokens
    assert [r["type"] for r in bad] == ["error"]
    for reply in ok + bad:
        assert reply["v"] == 1 and set(reply) <= V1_FIELDS[reply["type"]], reply
    assert bad[0]["code"] == "invalid_request" and "99999 at position 1" in bad[0]["message"]
    log = cluster.client.lrange(names.checkpoint_key("old-ok"), 0, -1)
    assert [orjson.loads(line)["v"] for line in log] == [1] * 8, "the log is in the entry's schema too"


def test_an_entry_of_an_unknown_schema_or_with_bad_fields_is_answered_not_dropped(cluster):
    ch = Channel(cluster, "unreadable")
    future = orjson.loads(protocol.encode(entry("from-v99", ch.name, prompt="hi")))
    xadd(cluster, orjson.dumps({**future, "v": 99, "shiny_new_field": True}))
    no_deadline = orjson.loads(protocol.encode(entry("no-deadline", ch.name, prompt="hi")))
    xadd(cluster, orjson.dumps({k: v for k, v in no_deadline.items() if k != "deadline"}))
    xadd(cluster, b"{not json at all")
    [unsupported] = ch.raw_replies("from-v99")
    [invalid] = ch.raw_replies("no-deadline")
    assert unsupported["code"] == "unsupported_schema" and unsupported["v"] == protocol.SCHEMA_VERSION
    assert "schema version 99" in unsupported["message"]
    assert invalid["code"] == "invalid_request" and invalid["v"] == protocol.SCHEMA_VERSION
    assert "deadline: Field required" in invalid["message"]
    deadline = time.monotonic() + 10
    while cluster.client.xlen(STREAM) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.client.xlen(STREAM) == 0, "undecodable entries are acknowledged, the garbage too"
    assert cluster.info("w1") is not None


@pytest.mark.parametrize("bad_line, why", [
    (b'{"v": 99, "type": "delta", "request_id": "x", "seq": 2, "pieces": ["?"]}', "unreadable"),
    (protocol.encode(protocol.Delta(request_id="x", seq=0, finish_reason=checkpoint.TRUNCATED)),
     "truncated"),
])
def test_a_takeover_of_an_unreadable_checkpoint_answers_resume_failed(cluster, bad_line, why):
    ch = Channel(cluster, f"takeover-{why}")
    rid = f"taken-{why}"
    first = protocol.Delta(request_id=rid, seq=1, text="Hi", token_ids=[11])
    cluster.client.rpush(names.checkpoint_key(rid), protocol.encode(first),
                         bad_line.replace(b'"x"', f'"{rid}"'.encode()))
    orphan(cluster, protocol.encode(entry(rid, ch.name, prompt_token_ids=[5, 6, 7])))
    [answer] = ch.raw_replies(rid)
    assert answer["type"] == "error" and answer["code"] == "resume_failed" and answer["retryable"]
    assert answer["seq"] == 2 and why in answer["message"]
    assert cluster.info("w1") is not None


def test_a_long_request_streams_in_full_and_its_log_stops_at_the_cap(cluster):
    ch = Channel(cluster, "long")
    xadd(cluster, protocol.encode(entry("long", ch.name, prompt="Tell me", params={"max_tokens": 80})))
    replies = ch.raw_replies("long", timeout=60)
    assert [r["seq"] for r in replies] == list(range(1, 83)) and replies[-1]["type"] == "done"
    lines = cluster.client.lrange(names.checkpoint_key("long"), 0, -1)
    seqs = [orjson.loads(line)["seq"] for line in lines]
    print(f"\n[checkpoint cap] {len(replies)} replies streamed; the log kept {len(lines)} lines, "
          f"{sum(map(len, lines))} bytes (cap {CAP})")
    assert seqs[-2:] == [0, 82], "the marker, then the last reply"
    assert sum(len(line) for line in lines[:-2]) <= CAP
    assert all(protocol.decode_reply(line) for line in lines), "every reader can decode every line"
    ckpt = checkpoint.load(cluster.client, "long")
    assert ckpt.truncated and ckpt.done and not ckpt.resumable
