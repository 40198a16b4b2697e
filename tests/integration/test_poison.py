"""No tenant can hurt the fleet: poison requests end alone, with one clear error each, among normal
streams on two real workers; an entry that crashes every worker taking it is retired by the poison
cap after at most KVGATE_MAX_DELIVERIES worker processes went down.

The poison entries are XADDed straight into the stream, as a gateway of the previous release (one
that does not validate token ids) would write them; the test listens on their reply channel.
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from shared import names, protocol
from tests.conftest import wire_entry
from tests.integration.test_faults import HEADERS, Cluster, _body, _client, _stream, _wait

STREAM = names.request_stream("demo", "v1")


@pytest.fixture
def cluster(tmp_path, tiny_model_dir):
    c = Cluster(tmp_path, tiny_model_dir)
    yield c
    c.close()


def start_all(cluster: Cluster, workers: dict[str, dict]) -> dict:
    """The gateway and the workers start side by side (a start is mostly imports)."""
    with ThreadPoolExecutor(len(workers) + 1) as pool:
        gateway = pool.submit(cluster.start_gateway)
        procs = {w: pool.submit(cluster.start_worker, w, **env) for w, env in workers.items()}
        gateway.result()
        return {w: f.result() for w, f in procs.items()}


entry = wire_entry


class Replies:
    """The test's own reply channel, subscribed before anything is sent."""

    def __init__(self, client: redis.Redis, channel: str):
        self.channel = channel
        self.pubsub = client.pubsub()
        self.pubsub.subscribe(channel)
        assert self.pubsub.get_message(timeout=5)["type"] == "subscribe"
        self.got: dict[str, list] = {}

    def collect(self, expect: set[str], timeout: float = 20, then: float = 1.0) -> None:
        """Until every request in `expect` has a reply, then `then` seconds more (a second answer
        to any of them would show)."""
        deadline = time.monotonic() + timeout
        while not expect <= set(self.got) and time.monotonic() < deadline:
            self._read_once()
        until = time.monotonic() + then
        while time.monotonic() < until:
            self._read_once()

    def _read_once(self) -> None:
        message = self.pubsub.get_message(timeout=0.2)
        if message and message["type"] == "message":
            for reply in protocol.decode_replies(message["data"]):
                self.got.setdefault(reply.request_id, []).append(reply)


def deliver_times(client: redis.Redis, raw: bytes, times: int) -> bytes:
    """XADD an entry and hand it to `times` consumers that are not workers (no registry entry: dead
    to a live worker), the first read atomic with the XADD so no live worker reads it first (the
    stream must hold no other undelivered entry: a read takes the oldest); the
    last claim leaves it idle long past the heartbeat TTL, so the next claim pass takes it."""
    with client.pipeline(transaction=True) as tx:
        tx.xadd(STREAM, {protocol.ENTRY_FIELD: raw})
        tx.xreadgroup(names.CONSUMER_GROUP, "dead-1", {STREAM: ">"}, count=1)
        entry_id, read = tx.execute()
    assert read and read[0][1][0][0] == entry_id, "dead-1 read another entry than the one added"
    for i in range(2, times + 1):
        idle = 60_000 if i == times else 0
        assert client.xclaim(STREAM, names.CONSUMER_GROUP, f"dead-{i}", min_idle_time=0,
                             message_ids=[entry_id], idle=idle)
    [pending] = client.xpending_range(STREAM, names.CONSUMER_GROUP, min=entry_id, max=entry_id, count=1)
    assert pending["times_delivered"] == times
    return entry_id


def metric_sum(cluster: Cluster, workers: list[str], name: str, **labels) -> float:
    total = 0.0
    for w in workers:
        text = httpx.get(cluster.info(w)["metrics_url"], timeout=5).text
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_three_poison_requests_among_twenty_streams_fail_alone(cluster):
    workers = ["w1", "w2"]
    procs = list(start_all(cluster, {w: {} for w in workers}).values())
    n = 20

    async def streams():
        async with _client(n) as client:
            return await asyncio.gather(*(_stream(client, cluster.url, _body(i, 16)) for i in range(n)))

    clean = asyncio.run(streams())
    assert all(r["error"] is None and r["finish"] == "length" for r in clean)
    replies = Replies(cluster.client, "kvgate:reply:poison-test")
    poison = {
        "oov-prompt": entry("oov-prompt", replies.channel, prompt_token_ids=[10000000]),
        "oov-stop": entry("oov-stop", replies.channel, prompt_token_ids=[5, 6, 7],
                          params={"stop_token_ids": [99999999], "min_tokens": 1}),
        "delivered-3x": entry("delivered-3x", replies.channel, prompt_token_ids=[5, 6, 7]),
    }

    async def mixed():
        # first, while nothing else waits in the stream (the first undelivered entry is what
        # the dead consumer reads); the workers take it over at their next claim pass, ~0.3 s on
        deliver_times(cluster.client, protocol.encode(poison["delivered-3x"]), 3)
        async with _client(n) as client:
            tasks = [asyncio.create_task(_stream(client, cluster.url, _body(i, 16))) for i in range(n)]
            await asyncio.sleep(0.05)  # the streams are being admitted when the poison arrives
            for rid in ("oov-prompt", "oov-stop"):
                cluster.client.xadd(STREAM, {protocol.ENTRY_FIELD: protocol.encode(poison[rid])})
            return await asyncio.gather(*tasks)

    results = asyncio.run(mixed())
    replies.collect(expect=set(poison))
    print(f"\n[poison] {sum(r['finish'] == 'length' for r in results)}/{n} streams complete; "
          f"poison answers: { {k: [r.code for r in v] for k, v in replies.got.items()} }")
    for got, want in zip(results, clean):
        assert got["error"] is None and got["finish"] == "length"
        assert got["text"] == want["text"], "a poison request must not change its batch-mates' text"
    assert set(replies.got) == set(poison)
    for rid, got in replies.got.items():
        assert len(got) == 1 and isinstance(got[0], protocol.ErrorReply), (rid, got)
    oov_prompt, oov_stop, capped = (replies.got[rid][0] for rid in poison)
    assert oov_prompt.code == "invalid_request" and oov_prompt.param == "prompt"
    assert oov_prompt.message == ("prompt token id 10000000 at position 0 is outside this model's "
                                  "vocabulary [0, 2048)")
    assert oov_stop.code == "invalid_request" and oov_stop.param == "stop_token_ids"
    assert "stop_token_ids value 99999999 at position 0" in oov_stop.message
    assert capped.code == "request_failed_repeatedly" and "3 times" in capped.message
    assert not capped.retryable
    assert all(p.poll() is None for p in procs), "both workers must be alive"
    assert all(cluster.info(w) is not None for w in workers)
    assert metric_sum(cluster, workers, "kvgate_requests_poisoned_total") == 1
    assert metric_sum(cluster, workers, "kvgate_request_failures_total", code="invalid_request") == 2
    assert cluster.client.xlen(STREAM) == 0, "every entry, poison included, is acknowledged"
    assert not cluster.client.xpending(STREAM, names.CONSUMER_GROUP)["pending"]
    after = asyncio.run(streams())
    assert [r["text"] for r in after] == [r["text"] for r in clean]


def test_a_request_that_crashes_every_worker_is_retired_after_n_deliveries(cluster):
    """A marked prompt makes a worker exit hard on admission (standing in for a segfault). With
    N = 2, the request takes down two worker processes (the first reader, then the one that took it
    over from the dead one); the third taker (a restart under the first's name, which finds the entry
    pending under its own name) answers it with request_failed_repeatedly."""
    env = {"KVGATE_FAULT_CRASH_MARKER": "CRASH-ME", "KVGATE_MAX_DELIVERIES": "2"}
    procs = start_all(cluster, {"w1": env, "w2": env})
    deaths: list[str] = []

    def supervise(done) -> None:
        """Restart a worker that died, as `kvgate up` would (without waiting for it to be ready)."""
        while not done.is_set():
            for name, proc in procs.items():
                if proc.poll() is not None:
                    deaths.append(name)
                    procs[name] = cluster._spawn(name, ["worker", "--model", str(cluster.model_dir),
                                                        "--served-name", "demo", "--redis-url",
                                                        cluster.redis.url],
                                                 {"KVGATE_HEARTBEAT_S": "0.3", "KVGATE_HEARTBEAT_TTL_S": "2",
                                                  "KVGATE_WORKER_ID": name, **env})
            time.sleep(0.1)

    async def scenario():
        done = threading.Event()
        watcher = asyncio.get_running_loop().run_in_executor(None, supervise, done)
        try:
            async with _client(2) as client:
                body = {**_body(0, 8), "prompt": "please CRASH-ME now", "stream": False}
                return await client.post(cluster.url + "/v1/completions", json=body, headers=HEADERS)
        finally:
            done.set()
            await watcher

    start = time.monotonic()
    resp = asyncio.run(scenario())
    took = time.monotonic() - start
    print(f"\n[crash marker] {len(deaths)} worker processes went down ({deaths}); the client got "
          f"{resp.status_code} {resp.json()['error']['code']} after {took:.1f}s")
    assert resp.status_code == 500, resp.text
    assert resp.json()["error"]["code"] == "request_failed_repeatedly"
    assert len(deaths) == 2, deaths
    for name, proc in procs.items():
        _wait(lambda name=name: cluster.info(name) is not None, proc)
    ok = httpx.post(cluster.url + "/v1/completions", headers=HEADERS, timeout=60,
                    json={**_body(1, 4), "stream": False})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length", ok.text
    assert cluster.client.xlen(STREAM) == 0
