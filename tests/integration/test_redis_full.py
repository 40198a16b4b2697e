"""A Redis that refuses writes (full under `maxmemory`, a read-only replica, unable to save) while
streams run: every route answers 503 with Retry-After and says why, streams pause and finish,
no process exits, and once Redis takes writes again everything serves as before.

Real processes (`kvgate gateway`, `kvgate worker`, a real redis-server); each refusal is made the
way it happens in production: CONFIG SET maxmemory, REPLICAOF, a failing BGSAVE.
"""
from __future__ import annotations

import asyncio
import shutil
import tempfile
import time

import httpx
import orjson
import pytest
import redis

from shared import names, protocol
from shared.redis_server import RedisServer
from tests.integration.test_faults import HEADERS, Cluster, _wait  # plain helpers

ADMIN = {"Authorization": "Bearer sk-kvg-redis-full-admin"}
STREAMS = 15


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    c = Cluster(tmp_path_factory.mktemp("redis-full"), tiny_model_dir)
    c.gateway = c.start_gateway(KVGATE_ADMIN_KEY=ADMIN["Authorization"][7:])
    c.worker = c.start_worker("w-full")
    c.pids = (c.gateway.pid, c.worker.pid)
    yield c
    c.close()


def _body(i: int, max_tokens: int = 60) -> dict:
    return {"model": "demo", "prompt": f"Stream {i} of the full Redis test", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One SSE stream to its end: text, finish reason, an error event, or the refusal."""
    out = {"text": "", "finish": None, "error": None, "status": None, "retry_after": None}
    async with client.stream("POST", url + "/v1/completions", json=body, headers=HEADERS) as resp:
        out["status"], out["retry_after"] = resp.status_code, resp.headers.get("retry-after")
        if resp.status_code != 200:
            out["error"] = orjson.loads(await resp.aread())["error"]
            return out
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                event = orjson.loads(line[6:])
                if "error" in event:
                    out["error"] = event["error"]
                else:
                    out["text"] += event["choices"][0]["text"]
                    out["finish"] = event["choices"][0]["finish_reason"] or out["finish"]
    return out


def _probe_every_route(url: str) -> dict[str, httpx.Response]:
    """One request to each kind of route: admission, dispatch, streaming, files, batches, admin."""
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    calls = {
        "models": ("GET", "/v1/models", HEADERS, {}),
        "completion": ("POST", "/v1/completions", HEADERS, {"json": {**_body(0, 3), "stream": False}}),
        "chat stream": ("POST", "/v1/chat/completions", HEADERS, {"json": {**chat, "stream": True}}),
        "upload": ("POST", "/v1/files", HEADERS, {"data": {"purpose": "batch"}, "files": {
            "file": ("in.jsonl", b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
                     b'"body": {"model": "demo", "messages": []}}\n')}}),
        "new key": ("POST", "/admin/keys", ADMIN, {"json": {"name": f"k{time.monotonic_ns()}"}}),
        "canary": ("PUT", "/admin/canary/demo", ADMIN, {"json": {"version": "v2", "stable": "v1",
                                                                 "weight": 10}}),
    }
    with httpx.Client(base_url=url, timeout=30) as client:
        return {name: client.request(method, path, headers=headers, **kw)
                for name, (method, path, headers, kw) in calls.items()}


def _assert_refused(responses: dict[str, httpx.Response], why: str) -> None:
    for name, resp in responses.items():
        assert resp.status_code == 503, f"{name}: {resp.status_code} {resp.text}"
        error = resp.json()["error"]
        assert error["code"] == "service_unavailable" and why in error["message"], (name, error)
        assert int(resp.headers["retry-after"]) >= 1, name


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url, timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not on {url}")


def _inject(cluster: Cluster, request_id: str, channel: str, deadline_s: float) -> None:
    """An entry with its own short deadline, XADDed as a gateway would."""
    now = time.time()
    entry = protocol.RequestEntry(
        request_id=request_id, reply_channel=channel, model="demo", version="v1", kind="completion",
        prompt_token_ids=[5, 6, 7], created=now, deadline=now + deadline_s,
        params=protocol.WireParams(max_tokens=1500, temperature=0, ignore_eos=True))
    cluster.client.xadd(names.request_stream("demo", "v1"), {protocol.ENTRY_FIELD: protocol.encode(entry)})


def _replies(pubsub, until, timeout: float = 30) -> list:
    got, deadline = [], time.monotonic() + timeout
    while not until(got):
        assert time.monotonic() < deadline, f"no such reply in {timeout}s: {got[-3:]}"
        message = pubsub.get_message(timeout=0.5)
        if message and message["type"] == "message":
            got += protocol.decode_replies(message["data"])
    return got


def _alive(cluster: Cluster) -> None:
    assert cluster.gateway.poll() is None and cluster.worker.poll() is None, "a process exited"
    assert (cluster.gateway.pid, cluster.worker.pid) == cluster.pids
    # the registry entry may have lapsed while Redis refused writes (a replica's dataset is its
    # primary's); the worker's next heartbeat writes it again
    _until(lambda: cluster.info("w-full") is not None, timeout=10)
    assert cluster.info("w-full")["worker_id"] == "w-full"


async def _during(cluster: Cluster, refuse, allow, hold_s: float, n: int = STREAMS):
    """n streams under way, then Redis refuses for `hold_s` (probing every route meanwhile),
    then takes writes again; the streams' outcomes and the probes' responses."""
    async with httpx.AsyncClient(timeout=120) as client:
        tasks = [asyncio.create_task(_stream(client, cluster.url, _body(i, 150))) for i in range(n)]
        await asyncio.sleep(0.5)  # under way
        await asyncio.to_thread(refuse)
        try:
            probes = await asyncio.to_thread(_probe_every_route, cluster.url)
            await asyncio.sleep(hold_s)
        finally:
            await asyncio.to_thread(allow)
        return await asyncio.gather(*tasks), probes


def _serves_again(cluster: Cluster) -> list[dict]:
    def ready() -> bool:
        return httpx.get(cluster.url + "/v1/models", headers=HEADERS, timeout=5).status_code == 200
    _wait(ready, cluster.gateway, timeout=30)

    async def after():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(_stream(client, cluster.url, _body(i)) for i in range(5)))
    results = asyncio.run(after())
    assert all(r["status"] == 200 and r["finish"] == "length" and not r["error"] for r in results), results
    return results


def _finished_or_clear(results: list[dict]) -> None:
    """A stream that started either finished or ended with a clear error event: none hung."""
    for r in results:
        if r["status"] != 200:
            assert r["status"] == 503 and r["retry_after"], r
        else:
            assert r["finish"] == "length" or (r["error"] and r["error"]["code"]), r


def test_full_redis_gives_503s_streams_pause_and_resume(cluster):
    metrics_url = cluster.info("w-full")["metrics_url"]
    reference = _serves_again(cluster)  # a clean run of the texts the streams must end with
    pubsub = cluster.client.pubsub()
    pubsub.subscribe("kvgate:reply:redis-full-test")
    _inject(cluster, "short-deadline-1", "kvgate:reply:redis-full-test", deadline_s=4)
    _replies(pubsub, lambda got: got)  # it runs
    seen = {}

    def refuse():
        cluster.client.config_set("maxmemory-policy", "noeviction")
        cluster.client.config_set("maxmemory", "1")  # tiny: every write that needs memory is refused
        seen["running"] = _metric(metrics_url, "kvgate_num_requests_running")
        seen["full_since"] = time.monotonic()

    def allow():
        deadline = time.monotonic() + 10  # the short request ends while Redis is still full
        while _metric(metrics_url, "kvgate_num_requests_running") > seen["running"] - 1:
            assert time.monotonic() < deadline, "the timed-out request kept its KV"
            time.sleep(0.2)
        seen["freed_while_full"] = True
        # past the 2 s heartbeat TTL: its registry entry lives on (EXPIRE needs no memory), so no
        # other worker would take its requests over
        time.sleep(max(0.0, seen["full_since"] + 3 - time.monotonic()))
        seen["registered_while_full"] = cluster.info("w-full") is not None
        cluster.client.config_set("maxmemory", "0")

    start = time.monotonic()
    results, probes = asyncio.run(_during(cluster, refuse, allow, hold_s=2))
    timed_out = _replies(pubsub, lambda got: any(isinstance(r, protocol.ErrorReply) for r in got))
    print(f"\n[redis full] {len(probes)} routes refused with 503 while full; {STREAMS} streams "
          f"paused and finished in {time.monotonic() - start:.1f}s; the request whose deadline "
          f"passed freed its KV while Redis was still full")
    # a read route's admission writes nothing for a key without a requests-per-minute limit (one
    # script, gateway/limits.py ADMIT), and Redis refuses only writes when it is out of memory
    models = probes.pop("models")
    assert models.status_code == 200 and models.json()["data"], models.text
    _assert_refused(probes, "Redis is out of memory (maxmemory)")
    assert seen["freed_while_full"] and seen["registered_while_full"]
    assert [r.code for r in timed_out if isinstance(r, protocol.ErrorReply)] == ["timeout"]
    _finished_or_clear(results)
    for got in results:  # nothing was lost: each text is the clean run's, token for token
        assert got["status"] == 200 and got["finish"] == "length" and not got["error"], got
    for got, clean in zip(results, reference):  # greedy: the clean run's 60 tokens come first
        assert got["text"].startswith(clean["text"]), (got["text"][:80], clean["text"])
    _alive(cluster)
    _serves_again(cluster)
    _alive(cluster)
    pubsub.close()


def test_read_only_replica_gives_503s_then_serves_again(cluster):
    """REPLICAOF another Redis (which first copied this one) makes ours a read-only replica, as
    after a failover; REPLICAOF NO ONE makes it a primary again, data intact."""
    other = RedisServer().start()
    peer = redis.Redis.from_url(other.url)

    def refuse():
        peer.replicaof("127.0.0.1", cluster.redis.port)
        _until(lambda: peer.info("replication").get("master_link_status") == "up")
        peer.replicaof("NO", "ONE")
        cluster.client.replicaof("127.0.0.1", other.port)
        _until(lambda: cluster.client.info("replication").get("master_link_status") == "up")

    try:
        results, probes = asyncio.run(_during(cluster, refuse, lambda: cluster.client.replicaof("NO", "ONE"),
                                              hold_s=2, n=5))
    finally:
        cluster.client.replicaof("NO", "ONE")
        other.stop()
    _assert_refused(probes, "Redis is read-only")
    _finished_or_clear(results)
    _alive(cluster)
    _serves_again(cluster)
    _alive(cluster)


def test_redis_that_cannot_save_gives_503s_then_serves_again(cluster):
    """MISCONF: a BGSAVE that fails (its folder is gone) makes Redis refuse writes until a save works."""
    folder = tempfile.mkdtemp(prefix="kvgate-misconf-")

    def refuse():
        cluster.client.config_set("save", "3600 1")  # refusing needs a save point and a failed save
        cluster.client.config_set("dir", folder)
        shutil.rmtree(folder)
        cluster.client.bgsave()
        _until(lambda: cluster.client.info("persistence")["rdb_last_bgsave_status"] == "err")

    def allow():
        cluster.client.config_set("dir", str(cluster.redis.data_dir))
        cluster.client.bgsave()
        _until(lambda: cluster.client.info("persistence")["rdb_last_bgsave_status"] == "ok")

    results, probes = asyncio.run(_during(cluster, refuse, allow, hold_s=2, n=5))
    _assert_refused(probes, "Redis cannot save to disk")
    _finished_or_clear(results)
    _alive(cluster)
    _serves_again(cluster)
    _alive(cluster)


def _until(condition, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "Redis did not get there"
        time.sleep(0.05)
