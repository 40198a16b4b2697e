"""Noisy neighbour at small scale: a real Redis and a real worker (tiny model, paged engine, one
sequence at a time, a 15 ms pause per step so a backlog forms); this test plays the gateway at the
protocol level. Tenant A queues a flood, tenant B sends two requests once A's first has finished.
Under the fair order B is served within a request or two of arriving, while most of A's backlog
still waits; under FIFO it waits behind all of A. The assertion is on the order of completions, not
on times, so a loaded machine cannot flake it."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import orjson
import pytest
import redis

from shared import names, protocol
from shared.redis_server import RedisServer, free_port
from tests.conftest import wire_entry

FLOOD, LIGHT = 8, 2


def _worker(tmp_path, model_dir, redis_url: str, fair: bool, seqs: int = 1, **extra: str) -> subprocess.Popen:
    env = {**os.environ, "KVGATE_WORKER_ID": "w1", "KVGATE_FAULT_STEP_MS": "15",
           "KVGATE_FAIR_ORDER": str(fair).lower(), "KVGATE_HEARTBEAT_S": "0.3", **extra}
    return subprocess.Popen([sys.executable, "-m", "kvgate", "worker", "--model", str(model_dir),
                             "--served-name", "demo", "--redis-url", redis_url, "--max-num-seqs", str(seqs)],
                            env=env, stdout=open(tmp_path / "worker.log", "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _done_order(client: redis.Redis, pubsub, stream: str, flood: list, light: list) -> list[str]:
    """XADD the flood, wait for its first request to finish, XADD the light requests; the request
    ids in the order their `done` arrived."""
    for entry in flood:
        client.xadd(stream, {protocol.ENTRY_FIELD: protocol.encode(entry)})
    done: list[str] = []
    deadline = time.monotonic() + 120
    while len(done) < len(flood) + len(light) and time.monotonic() < deadline:
        message = pubsub.get_message(timeout=1)
        if not message or message["type"] != "message":
            continue
        for reply in protocol.decode_replies(message["data"]):
            assert reply.type != "error", reply
            if reply.type == "done":
                done.append(reply.request_id)
                if len(done) == 1:
                    for entry in light:
                        client.xadd(stream, {protocol.ENTRY_FIELD: protocol.encode(entry)})
    assert len(done) == len(flood) + len(light), f"only {len(done)} requests finished: {done}"
    return done


def _ready(client: redis.Redis, proc: subprocess.Popen, tmp_path) -> None:
    deadline = time.monotonic() + 120
    while client.get(names.worker_key("w1")) is None:
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "worker.log").read_text()
        time.sleep(0.2)
    print(f"worker ready in {time.monotonic() - deadline + 120:.1f} s")


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "fifo"])
def test_a_light_tenant_is_not_queued_behind_a_flood(tmp_path, tiny_model_dir, fair):
    server = RedisServer(port=free_port(), data_dir=tmp_path / "redis").start()
    client = redis.Redis.from_url(server.url)
    proc = _worker(tmp_path, tiny_model_dir, server.url, fair)
    try:
        _ready(client, proc, tmp_path)
        channel = names.reply_channel("fair-test")
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(channel)
        flood = [wire_entry(f"a{i}", channel, max_tokens=8, key_id="tenant-a", prompt=f"flood {i} says")
                 for i in range(FLOOD)]
        light = [wire_entry(f"b{i}", channel, max_tokens=8, key_id="tenant-b", prompt=f"light {i} says")
                 for i in range(LIGHT)]
        done = _done_order(client, pubsub, names.request_stream("demo", "v1"), flood, light)
        a_before_b = sum(1 for rid in done[:max(done.index(b.request_id) for b in light)] if rid[0] == "a")
        print(f"fair={fair}: completion order {' '.join(done)}; {a_before_b} of A's {FLOOD} before B's last")
        if fair:  # A's first (before B was sent), the one running when B is read, one more on the
            # lift's tie (B starts level with A, and the older entry wins a tie), then B interleaves
            assert a_before_b <= 5, done
        else:  # FIFO: B waits behind the whole flood
            assert a_before_b == FLOOD, done
    finally:
        proc.terminate()
        proc.wait(30)
        client.close()
        server.stop()


@pytest.mark.parametrize("yielding", [True, False], ids=["yield", "wait"])
def test_a_light_tenant_below_its_share_starts_in_a_full_batch(tmp_path, tiny_model_dir, yielding):
    """Two sequence slots, both A's; A's requests have different lengths, so its first finishes
    well before its second. B is sent when A's first is done (A's second still has 16 tokens to go,
    its third just started). With yielding, B (below its share of one slot in two) takes the slot
    of A's newest sequence and finishes before A's second; waiting for a slot, it cannot."""
    server = RedisServer(port=free_port(), data_dir=tmp_path / "redis").start()
    client = redis.Redis.from_url(server.url)
    proc = _worker(tmp_path, tiny_model_dir, server.url, fair=True, seqs=2,
                   KVGATE_FAIR_YIELD=str(yielding).lower())
    try:
        _ready(client, proc, tmp_path)
        channel = names.reply_channel("yield-test")
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(channel)
        flood = [wire_entry(f"a{i}", channel, max_tokens=12 + 16 * i, key_id="tenant-a",
                            prompt=f"flood {i} says") for i in range(4)]
        light = [wire_entry("b0", channel, max_tokens=4, key_id="tenant-b", prompt="light says")]
        done = _done_order(client, pubsub, names.request_stream("demo", "v1"), flood, light)
        stats = orjson.loads(client.get(names.worker_key("w1")))["stats"]
        print(f"yielding={yielding}: completion order {' '.join(done)}; stats {stats}")
        if yielding:
            assert done.index("b0") < done.index("a1"), done
            assert stats["num_fair_preemptions"] >= 1
        else:
            assert done.index("a1") < done.index("b0"), done
            assert stats["num_fair_preemptions"] == 0
    finally:
        proc.terminate()
        proc.wait(30)
        client.close()
        server.stop()
