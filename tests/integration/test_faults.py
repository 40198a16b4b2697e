"""Nothing lost: each fault from issue 6 injected into real processes; each test prints its figure.

Redis, gateway and workers are separate processes started with the same entry points compose uses
(`kvgate gateway`, `kvgate worker`), so a test can kill or pause any one of them.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest
import redis

from shared import names
from shared.redis_server import RedisServer, free_port

KEY = "sk-kvg-fault-test-key"
FAST_HEARTBEAT = {"KVGATE_HEARTBEAT_S": "0.3", "KVGATE_HEARTBEAT_TTL_S": "2"}


def fresh_entry(info, worker_id: str, timeout: float = 10) -> dict:
    """The worker's registry entry (`info(worker_id)`) written after this call: its counts include
    everything that finished before it (the latest may be a heartbeat old, 0.3 s in these tests; a
    loaded host stretches that)."""
    asked = time.time()
    deadline = time.monotonic() + timeout
    while (entry := info(worker_id)) is None or entry["ts"] < asked:
        assert time.monotonic() < deadline, f"{worker_id} wrote no heartbeat in {timeout}s"
        time.sleep(0.05)
    return entry


class Cluster:
    def __init__(self, root: Path, model_dir: Path):
        self.root, self.model_dir = root, model_dir
        self.redis = RedisServer(port=free_port(), data_dir=root / "redis", persist=True).start()
        self.client = redis.Redis.from_url(self.redis.url)
        self.procs: list[subprocess.Popen] = []
        self.url = ""

    def _spawn(self, name: str, args: list[str], env: dict) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "kvgate", *args], stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def start_gateway(self, **env) -> subprocess.Popen:
        port = free_port()
        # its metrics folder under the test's own: close() kills, and a killed gateway cannot remove it
        proc = self._spawn("gateway", ["gateway", "--port", str(port), "--redis-url", self.redis.url],
                           {"KVGATE_API_KEY": KEY, "KVGATE_SECRET": "fault-test-secret",
                            "PROMETHEUS_MULTIPROC_DIR": str(self.root / f"metrics-{port}"), **env})
        self.url = f"http://127.0.0.1:{port}"
        _wait(lambda: httpx.get(self.url + "/readyz", timeout=1).status_code == 200, proc)
        return proc

    def start_worker(self, name: str, *flags: str, **env) -> subprocess.Popen:
        return self.worker_ready(name, self.spawn_worker(name, *flags, **env))

    def spawn_worker(self, name: str, *flags: str, **env) -> subprocess.Popen:
        """A worker started, not waited for: several spawned before any is waited for start side by side."""
        return self._spawn(name, ["worker", "--model", str(self.model_dir), "--served-name", "demo",
                                  "--redis-url", self.redis.url, *flags],
                           {**FAST_HEARTBEAT, "KVGATE_WORKER_ID": name, **env})

    def worker_ready(self, name: str, proc: subprocess.Popen) -> subprocess.Popen:
        """`proc` once its registry entry is written."""
        _wait(lambda: self.info(name) is not None, proc)
        return proc

    def info(self, worker_id: str) -> dict | None:
        raw = self.client.get(names.worker_key(worker_id))
        return orjson.loads(raw) if raw else None

    def fresh_info(self, worker_id: str, timeout: float = 10) -> dict:
        return fresh_entry(self.info, worker_id, timeout)

    def restart_redis_after(self, seconds: float) -> None:
        self.redis.proc.terminate()  # redis saves its data on SIGTERM (persistence is on)
        self.redis.proc.wait(10)
        time.sleep(seconds)
        self.redis.start()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.redis.stop()


def _wait(ready, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"process exited with {proc.returncode}"
        try:
            if ready():
                return
        except (httpx.HTTPError, redis.RedisError):
            pass
        time.sleep(0.1)
    raise TimeoutError("process did not become ready")


@pytest.fixture
def cluster(tmp_path, tiny_model_dir):
    c = Cluster(tmp_path, tiny_model_dir)
    yield c
    c.close()


HEADERS = {"Authorization": f"Bearer {KEY}"}


def _body(i: int, max_tokens: int, **extra) -> dict:
    return {"model": "demo", "prompt": f"Request number {i} says", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, **extra}


async def _stream(client: httpx.AsyncClient, url: str, body: dict, on_chunk=None) -> dict:
    """One SSE stream: text, finish reason, chunk times, or the HTTP status if refused."""
    out = {"text": "", "finish": None, "times": [], "status": None, "error": None}
    start = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=body, headers=HEADERS) as resp:
        out["status"] = resp.status_code
        if resp.status_code != 200:
            out["retry_after"] = resp.headers.get("retry-after")
            out["error"] = orjson.loads(await resp.aread())["error"]
            return out
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]
                continue
            choice = event["choices"][0]
            out["text"] += choice["text"]
            out["finish"] = choice["finish_reason"] or out["finish"]
            out["times"].append(time.perf_counter() - start)
            if on_chunk:
                on_chunk()
    return out


def _client(n: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=180, limits=httpx.Limits(max_connections=n + 8))


def test_worker_killed_mid_stream_its_requests_resume_on_the_other(cluster):
    cluster.start_gateway()
    # takes half of the 50: FIFO reads only its room, so the other 25 stay in the stream for the
    # survivor (the fair order's look-ahead would hold them here); the survivor claims in fair order.
    # Its steps are slowed (a slow device, 50 ms): its 120-token streams last 6 s, so they are still
    # running when the survivor is up however long that takes on a busy host (unslowed, the victim
    # once finished all 25 first, and `active == 25` read 0)
    victim = cluster.start_worker("w-victim", "--max-num-seqs", "25", KVGATE_FAIR_ORDER="false",
                                  KVGATE_FAULT_STEP_MS="50")
    n, max_tokens = 50, 120
    chunks = [0]

    async def scenario():
        async with _client(n) as client:
            tasks = [asyncio.create_task(_stream(client, cluster.url, _body(i, max_tokens),
                                                 lambda: chunks.__setitem__(0, chunks[0] + 1)))
                     for i in range(n)]
            while chunks[0] < 25 * 5:  # the victim's requests are mid-stream
                await asyncio.sleep(0.01)
            # the survivor takes the 25 still queued and has room left for the victim's 25
            await asyncio.get_running_loop().run_in_executor(None, cluster.start_worker, "w-survivor")
            assert cluster.info("w-victim")["active"] == 25
            victim.send_signal(signal.SIGKILL)
            results = await asyncio.gather(*tasks)
            reference = await asyncio.gather(*(_stream(client, cluster.url, _body(i, max_tokens))
                                               for i in range(n)))
            return results, reference

    results, reference = asyncio.run(scenario())
    resumed = cluster.fresh_info("w-survivor")["requests_resumed"]
    worst_gap = max(max(b - a for a, b in zip(r["times"], r["times"][1:])) for r in results)
    print(f"\n[fault 1] {resumed} requests resumed on the survivor; longest pause in a stream "
          f"{worst_gap:.2f}s (heartbeat TTL 2s)")
    assert resumed == 25
    for got, want in zip(results, reference):
        assert got["error"] is None and got["finish"] == "length"
        assert got["text"] == want["text"], "resumed text must equal an uninterrupted run"


def test_disconnected_clients_free_every_block_and_leave_no_untimed_keys(cluster):
    cluster.start_gateway()
    # Steps slowed (20 ms: 1500 tokens take 30 s): a client that left is cancelled by the sweep
    # once its resume grace (3 s) lapses, and unslowed on a fast host (an Intel Xeon) a dozen of
    # the 100 streams finished all their tokens first and were settled as done, never aborted
    cluster.start_worker("w1", KVGATE_FAULT_STEP_MS="20")
    idle = cluster.info("w1")["stats"]
    n = 100

    async def open_and_drop(client, i):
        async with client.stream("POST", cluster.url + "/v1/completions", json=_body(i, 1500),
                                 headers=HEADERS) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    return  # leave after the first event: the client goes away

    async def scenario():
        async with _client(n) as client:
            await asyncio.gather(*(open_and_drop(client, i) for i in range(n)))

    start = time.perf_counter()
    asyncio.run(scenario())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        info = cluster.info("w1")
        if info["requests_aborted"] >= n and info["active"] == 0 and info["stats"]["num_running"] == 0:
            break
        time.sleep(0.1)
    took = time.perf_counter() - start
    info = cluster.info("w1")
    print(f"\n[fault 2] {info['requests_aborted']} aborted, all blocks back {took:.2f}s after the "
          f"first client left; free blocks {info['stats']['num_free_blocks']}/{info['stats']['num_blocks']}")
    # each once: an entry whose ack was still queued when the worker looked for its lost entries
    # was claimed back and counted aborted again (102-174 of 100 before)
    assert info["requests_aborted"] == n and info["active"] == 0
    assert info["stats"]["num_running"] == 0 and info["stats"]["num_waiting"] == 0
    assert info["stats"]["num_free_blocks"] == idle["num_free_blocks"] == idle["num_blocks"]
    untimed = [k.decode() for k in cluster.client.scan_iter("*") if cluster.client.ttl(k) == -1]
    allowed = names.permanent_keys("demo", "v1")
    assert set(untimed) <= allowed, f"keys without a TTL: {sorted(set(untimed) - allowed)}"
    assert cluster.client.xlen(names.request_stream("demo", "v1")) == 0


def test_redis_outage_gives_503s_then_everything_works_again(cluster):
    gateway = cluster.start_gateway()
    worker = cluster.start_worker("w1")
    warm = httpx.post(cluster.url + "/v1/completions", headers=HEADERS, timeout=30,
                      json={**_body(0, 2), "stream": False})  # the load was running before the outage
    assert warm.status_code == 200, warm.text
    statuses: list[int] = []

    async def probe(client):
        try:
            r = await client.post(cluster.url + "/v1/completions", headers=HEADERS,
                                  json={**_body(0, 4), "stream": False}, timeout=15)
            statuses.append(r.status_code)
            assert r.status_code in (200, 503), r.text
            if r.status_code == 503:
                assert r.json()["error"]["type"] and r.headers.get("retry-after")
        except httpx.TimeoutException:
            statuses.append(-1)

    async def load_during_outage():
        async with _client(20) as client:
            outage = asyncio.get_running_loop().run_in_executor(None, cluster.restart_redis_after, 5)
            probes = []
            while not outage.done():  # a new request every 0.2 s, whatever the earlier ones do
                probes.append(asyncio.create_task(probe(client)))
                await asyncio.sleep(0.2)
            await outage
            await asyncio.gather(*probes)

    asyncio.run(load_during_outage())
    assert gateway.poll() is None and worker.poll() is None, "no process may crash"
    _wait(lambda: cluster.info("w1") is not None, worker)

    async def after():
        async with _client(20) as client:
            return await asyncio.gather(*(_stream(client, cluster.url, _body(i, 8)) for i in range(20)))

    def serving() -> bool:  # recovered = the gateway says ready and lists the model again
        models = httpx.get(cluster.url + "/v1/models", headers=HEADERS, timeout=2)
        if models.status_code != 200:  # e.g. 503 while Redis is still coming back
            return False
        return httpx.get(cluster.url + "/readyz", timeout=2).status_code == 200 and \
            [m["id"] for m in models.json()["data"]] == ["demo"]
    _wait(serving, gateway, timeout=30)
    results = asyncio.run(after())
    print(f"\n[fault 3] during the 5s outage: {statuses.count(503)} x 503, {statuses.count(200)} x 200, "
          f"{statuses.count(-1)} timeouts; after it: {sum(r['status'] == 200 for r in results)}/20 ok")
    assert 503 in statuses and -1 not in statuses
    failed = [r for r in results if not (r["status"] == 200 and r["finish"] == "length")]
    assert not failed, [(r["status"], r["error"], r["finish"]) for r in failed]


def test_sigterm_drains_a_worker_without_losing_requests(cluster):
    cluster.start_gateway()
    leaving = cluster.spawn_worker("w-leaving", "--max-num-seqs", "15")  # so both get half
    cluster.worker_ready("w-staying", cluster.spawn_worker("w-staying", "--max-num-seqs", "15"))
    cluster.worker_ready("w-leaving", leaving)
    n = 30
    chunks = [0]

    async def scenario():
        async with _client(n) as client:
            tasks = [asyncio.create_task(_stream(client, cluster.url, _body(i, 200),
                                                 lambda: chunks.__setitem__(0, chunks[0] + 1)))
                     for i in range(n)]
            deadline = time.monotonic() + 10
            # every stream under way, and the leaving worker's heartbeat (every 0.3 s) says so
            while chunks[0] < n or (not cluster.info("w-leaving")["active"]
                                    and time.monotonic() < deadline):
                await asyncio.sleep(0.01)
            in_flight = cluster.info("w-leaving")["active"]
            leaving.send_signal(signal.SIGTERM)
            return in_flight, await asyncio.gather(*tasks)

    in_flight, results = asyncio.run(scenario())
    code = leaving.wait(60)
    print(f"\n[fault 4] SIGTERM with {in_flight} requests in flight on the leaving worker; "
          f"exit code {code}; {sum(r['finish'] == 'length' for r in results)}/{n} complete")
    assert in_flight > 0 and code == 0
    assert all(r["error"] is None and r["finish"] == "length" for r in results)


def _p99(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))] if values else float("nan")


def test_overload_sheds_with_503_and_short_requests_are_not_starved(cluster):
    # capacity: 8 running sequences in a 48-block pool (a long request needs 9 blocks), queue depth 40
    cluster.start_gateway(KVGATE_MAX_STREAM_DEPTH="40")
    cluster.start_worker("w1", "--max-num-seqs", "8", "--kv-cache-memory", str(48 * 16 * 512),
                         "--max-num-batched-tokens", "64")
    long_body = dict(prompt="long " * 40, max_tokens=100, priority=1)  # a key may only lower its own

    async def scenario():
        async with _client(200) as client:
            def go(bodies):
                return [asyncio.create_task(_stream(client, cluster.url, b)) for b in bodies]
            longs = go([_body(i, **long_body) for i in range(30)])
            await asyncio.sleep(0.5)
            shorts = go([_body(i, 4) for i in range(30)])
            await asyncio.sleep(0.1)
            burst = go([_body(i, **long_body) for i in range(90)])  # 5x what it can hold
            return [await asyncio.gather(*t) for t in (longs, shorts, burst)]

    longs, shorts, burst = asyncio.run(scenario())
    results = longs + shorts + burst
    ok = [r for r in results if r["status"] == 200]
    shed = [r for r in results if r["status"] == 503]
    short_ttft = _p99([r["times"][0] for r in shorts if r["status"] == 200 and r["times"]])
    long_ttft = _p99([r["times"][0] for r in longs if r["status"] == 200 and r["times"]])
    stats = cluster.info("w1")["stats"]
    print(f"\n[fault 5] {len(results)} offered: {len(ok)} served, {len(shed)} shed with 503; "
          f"preemptions {stats['num_preemptions']}; TTFT p99 short {short_ttft:.3f}s "
          f"(served {sum(r['status'] == 200 for r in shorts)}/30), long {long_ttft:.3f}s")
    assert len(ok) + len(shed) == len(results)
    assert shed and all(r["retry_after"] for r in shed)
    assert all(r["error"] is None and r["finish"] == "length" for r in ok)
    assert stats["num_preemptions"] > 0
    assert all(r["status"] == 200 for r in longs)


def test_cancel_before_pickup_is_honoured_and_deadlines_are_enforced(cluster):
    cluster.start_gateway(KVGATE_REQUEST_TIMEOUT_S="1")
    cluster.start_worker("w1", "--engine", "hf")  # one request at a time, ~ms per token: 2,000 take > 1 s

    async def scenario():
        async with _client(4) as client:
            busy = asyncio.create_task(_stream(client, cluster.url, _body(0, 2000)))
            while not cluster.info("w1")["active"]:
                await asyncio.sleep(0.05)
            queued = asyncio.create_task(_stream(client, cluster.url, _body(1, 8)))
            await asyncio.sleep(0.5)
            queued.cancel()  # the client leaves while its entry still waits in the stream
            return await busy

    busy = asyncio.run(scenario())
    assert busy["error"] is not None and busy["error"]["code"] == "timeout", busy
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        info = cluster.info("w1")
        if info["requests_aborted"] >= 2 and info["active"] == 0:
            break
        time.sleep(0.1)
    info = cluster.info("w1")
    print(f"\n[deadline/cancel] timed-out stream ended with code {busy['error']['code']}; worker "
          f"admitted {info['requests_admitted']}, aborted {info['requests_aborted']}")
    assert info["requests_admitted"] == 1, "the cancelled entry must never start"
    assert info["requests_aborted"] == 2 and info["active"] == 0


def test_an_entry_whose_read_answer_was_lost_is_served_by_its_live_worker(cluster):
    """Redis delivered the entry to w1 (it is pending under w1's name) but w1 never got the answer
    to that read, as when a connection breaks mid-pipeline; w1 must take it back by itself."""
    from shared import protocol

    cluster.start_worker("w1")
    stream, channel = names.request_stream("demo", "v1"), "kvgate:reply:lost-read-test"
    replies = cluster.client.pubsub()
    replies.subscribe(channel)
    assert replies.get_message(timeout=5)["type"] == "subscribe"
    now = time.time()
    entry = protocol.RequestEntry(
        request_id="lost-read-1", reply_channel=channel, model="demo", version="v1", kind="completion",
        prompt_token_ids=[5, 6, 7], created=now, deadline=now + 60,
        params=protocol.WireParams(max_tokens=3, temperature=0, ignore_eos=True))
    with cluster.client.pipeline(transaction=True) as tx:  # atomic: w1's own loop cannot read it first
        tx.xadd(stream, {protocol.ENTRY_FIELD: protocol.encode(entry)})
        tx.xreadgroup(names.CONSUMER_GROUP, "w1", {stream: ">"}, count=1)
        assert tx.execute()[1], "the entry was not delivered to w1"
    start, got = time.monotonic(), []
    while not any(isinstance(r, protocol.Done) for r in got):
        assert time.monotonic() - start < 20, f"w1 never served its lost entry (got {got})"
        message = replies.get_message(timeout=1)
        if message and message["type"] == "message":
            got += protocol.decode_replies(message["data"])
    tokens = [t for r in got if isinstance(r, protocol.Delta) for t in r.token_ids]
    print(f"\nlost read: served after {time.monotonic() - start:.1f} s (heartbeat TTL 2 s), "
          f"{len(tokens)} tokens")
    assert len(tokens) == 3 and cluster.client.xlen(stream) == 0
    replies.close()
