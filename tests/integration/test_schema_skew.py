"""Rolling upgrades, gateway side: a gateway of this version in front of workers of the previous
release (schema 1) and of a release it does not know. The old worker is played at the protocol
level by the test: it registers the way the previous release's heartbeat did (no `schema` field),
reads its stream, and answers in schema 1 — the messages of shared/protocol.py written down."""
from __future__ import annotations

import threading
import time

import httpx
import orjson
import pytest
import redis

from shared import names, protocol
from tests.integration.test_faults import HEADERS, Cluster, _wait  # plain helpers

MODEL, VERSION = "legacy", "v1"


class ProtocolPeer(threading.Thread):
    """A worker of another release, as Redis sees it: a registry entry, a consumer of the stream,
    replies on the entry's reply channel in schema `speaks`."""

    def __init__(self, redis_url: str, speaks: int, advertise: bool):
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(redis_url)
        self.speaks, self.advertise = speaks, advertise
        self.entries: list[dict] = []
        self.stopping = threading.Event()
        self.stream = names.request_stream(MODEL, VERSION)
        self.client.xgroup_create(self.stream, names.CONSUMER_GROUP, id="0", mkstream=True)
        self._register()

    def _info(self) -> dict:
        """What this worker registers, written in one SET (a gateway reading between two writes
        would see half of it)."""
        info = {"worker_id": "peer", "served_name": MODEL, "version": VERSION, "ts": time.time(),
                "max_model_len": 64}
        if self.advertise:
            info["schema"] = self.speaks
        return info

    def _register(self) -> None:
        info = self._info()
        self.client.set(names.worker_key("peer"), orjson.dumps(info), ex=10)
        self.client.zadd(names.WORKERS_ZSET, {"peer": time.time() + 10})
        self.client.hset(names.model_versions_key(MODEL), VERSION, b"{}")

    def run(self) -> None:
        while not self.stopping.is_set():
            self._register()
            reply = self.client.xreadgroup(names.CONSUMER_GROUP, "peer", {self.stream: ">"},
                                           count=1, block=200)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    raw = orjson.loads(fields[protocol.ENTRY_FIELD])
                    self.entries.append(raw)
                    self._answer(raw)
                    self.client.xack(self.stream, names.CONSUMER_GROUP, entry_id)

    def _answer(self, entry: dict) -> None:
        rid, channel = entry["request_id"], entry["reply_channel"]
        replies = [{"v": self.speaks, "type": "delta", "request_id": rid, "seq": 1, "index": 0,
                    "text": "old ", "token_ids": [5]},
                   {"v": self.speaks, "type": "delta", "request_id": rid, "seq": 2, "index": 0,
                    "text": "worker", "token_ids": [6], "finish_reason": "length"},
                   {"v": self.speaks, "type": "done", "request_id": rid, "seq": 3,
                    "prompt_tokens": 2, "completion_tokens": 2}]
        raws = [orjson.dumps(r) for r in replies]
        for raw in raws:
            self.client.rpush(names.checkpoint_key(rid), raw)
        self.client.expire(names.checkpoint_key(rid), 60)
        self.client.publish(channel, b"[" + b",".join(raws) + b"]")


@pytest.fixture
def cluster(tmp_path, tiny_model_dir):
    c = Cluster(tmp_path, tiny_model_dir)
    c.peers = []
    yield c
    for peer in c.peers:
        peer.stopping.set()
        peer.join(5)
    c.close()


def _peer(cluster: Cluster, speaks: int, advertise: bool) -> ProtocolPeer:
    peer = ProtocolPeer(cluster.redis.url, speaks, advertise)
    cluster.peers.append(peer)
    peer.start()
    _wait(lambda: MODEL in [m["id"] for m in httpx.get(cluster.url + "/v1/models", headers=HEADERS,
                                                          timeout=2).json()["data"]], cluster.procs[0])
    return peer


def test_a_gateway_writes_schema_1_to_a_previous_release_worker_and_reads_its_answers(cluster):
    cluster.start_gateway()
    peer = _peer(cluster, speaks=1, advertise=False)  # the previous release said nothing of schemas
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    resp = httpx.post(cluster.url + "/v1/completions", json=body, headers=HEADERS, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "old worker"
    assert resp.json()["usage"]["completion_tokens"] == 2
    with httpx.stream("POST", cluster.url + "/v1/completions", json={**body, "stream": True},
                      headers=HEADERS, timeout=30) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: {")]
    assert "".join(orjson.loads(e[6:])["choices"][0]["text"] for e in events) == "old worker"
    assert [e["v"] for e in peer.entries] == [1, 1]
    # what the previous release's RequestEntry declared, nothing newer
    assert all(set(e) <= set(protocol.RequestEntry.model_fields) for e in peer.entries)


def test_replies_of_a_schema_this_gateway_does_not_speak_end_the_request_at_once(cluster):
    cluster.start_gateway()
    peer = _peer(cluster, speaks=99, advertise=True)
    start = time.monotonic()
    resp = httpx.post(cluster.url + "/v1/completions", headers=HEADERS, timeout=60,
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert time.monotonic() - start < 10, "the request waited instead of failing"
    assert resp.status_code == 500, resp.text
    err = resp.json()["error"]
    assert err["code"] == "unsupported_schema" and "schema" in err["message"]
    assert peer.entries[0]["v"] == protocol.SCHEMA_VERSION  # it advertised a newer one: ours is written


def test_tokenize_is_never_sent_to_a_worker_of_schema_4_or_older(cluster):
    cluster.start_gateway()
    peer = _peer(cluster, speaks=4, advertise=True)
    for path, body in (("/tokenize", {"model": MODEL, "prompt": "hi"}),
                       ("/detokenize", {"model": MODEL, "tokens": [5, 6]})):
        resp = httpx.post(cluster.url + path, json=body, headers=HEADERS, timeout=30)
        assert resp.status_code == 503 and resp.headers["Retry-After"], resp.text
        assert resp.json()["error"]["code"] == "upgrade_in_progress"
    assert peer.entries == []  # nothing it could not read was queued
