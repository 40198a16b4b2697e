"""The refusals Redis makes for a while are told apart from errors waiting will not fix, whether
they come from a plain command, a pipeline or inside a Lua script (errors from a real server)."""
from __future__ import annotations

import asyncio
import time

import pytest
import redis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from redis._parsers import _RESP2Parser
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ClusterError, CrossSlotTransactionError, SlotNotCoveredError

from gateway.errors import install
from shared.redis_errors import FAILING_OVER, refusal
from shared.redis_server import RedisServer, closed_port


def _parsed(reply: str) -> redis.RedisError:
    """The exception redis-py raises for this error reply from a server."""
    return _RESP2Parser(socket_read_size=65536).parse_error(reply)


def _error(call) -> redis.RedisError:
    with pytest.raises(redis.RedisError) as info:
        call()
    return info.value


def test_a_full_redis_is_a_refusal_from_commands_pipelines_and_scripts(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", "1")
    try:
        plain = _error(lambda: client.rpush("kvgate:test:list", "x"))
        script = _error(lambda: client.eval("return redis.call('SET', KEYS[1], 'x')", 1, "kvgate:test:k"))
        with client.pipeline(transaction=True) as tx:
            tx.set("kvgate:test:k", "x")
            piped = _error(tx.execute)
    finally:
        client.config_set("maxmemory", "0")
    for exc in (plain, script, piped):
        assert refusal(exc) == "Redis is out of memory (maxmemory)", exc


def test_a_replica_loading_or_unreachable_redis_is_a_refusal(redis_server):
    with RedisServer() as replica:
        client = redis.Redis.from_url(replica.url)
        client.replicaof("127.0.0.1", redis_server.port)
        deadline = time.monotonic() + 10
        while client.info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert refusal(_error(lambda: client.set("k", "v"))).startswith("Redis is read-only")
    loading = _parsed("LOADING Redis is loading the dataset in memory")
    assert refusal(loading) == "Redis is loading its data set"
    misconf = _parsed("MISCONF Redis is configured to save RDB snapshots, but ...")
    assert refusal(misconf).startswith("Redis cannot save to disk")
    gone = redis.Redis(port=closed_port(), socket_connect_timeout=0.5)  # nothing listens there
    assert refusal(_error(gone.ping)) == "Redis is unreachable"


def test_errors_waiting_cannot_fix_are_not_refusals(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.set("kvgate:test:string", "x")
    wrongtype = _error(lambda: client.rpush("kvgate:test:string", "y"))
    nogroup = _error(lambda: client.xreadgroup("no-group", "me", {"kvgate:test:nostream": ">"}))
    busygroup_text = _parsed("BUSYGROUP Consumer Group name already exists")
    for exc in (wrongtype, nogroup, busygroup_text):
        assert refusal(exc) is None, exc


def _cluster_errors() -> dict[str, BaseException]:
    """What redis-py's cluster client raises in an outage, most of it no RedisError: no node
    reachable (from a real client), a slot no node serves mid-failover, redirections that never
    settle, CLUSTERDOWN and MASTERDOWN replies."""
    async def unreachable() -> BaseException:
        client = RedisCluster(host="127.0.0.1", port=closed_port(), socket_connect_timeout=0.2)
        with pytest.raises(BaseException) as info:
            await client.ping()
        return info.value

    return {"unreachable": asyncio.run(unreachable()),
            "not covered": SlotNotCoveredError("Slot 866 not covered by the cluster"),
            "ttl": ClusterError("TTL exhausted."),
            "down": _parsed("CLUSTERDOWN The cluster is down"),
            "master down": _parsed("MASTERDOWN Link with MASTER is down")}


def test_a_cluster_in_failover_is_a_refusal_and_the_gateway_answers_503_with_retry_after():
    errors = _cluster_errors()
    assert not isinstance(errors["unreachable"], redis.RedisError)  # why RedisError alone is not enough
    assert {k: refusal(e) for k, e in errors.items()} == {
        "unreachable": "Redis is unreachable", "not covered": FAILING_OVER, "ttl": FAILING_OVER,
        "down": "the Redis cluster is down", "master down": "Redis's primary is down"}
    assert refusal(CrossSlotTransactionError("All keys ... same slot")) is None  # a bug, said loudly

    app = FastAPI()
    install(app)

    @app.get("/fail/{kind}")
    async def fail(kind: str):
        raise errors[kind] if kind in errors else CrossSlotTransactionError("keys in two slots")

    with TestClient(app) as client:
        for kind in [*errors, "crossslot"]:
            resp = client.get(f"/fail/{kind}")
            assert resp.status_code == 503 and resp.headers["retry-after"] == "1", (kind, resp.text)
            error = resp.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["message"].endswith("; retry shortly")
            if kind != "crossslot":
                assert error["message"].startswith(refusal(errors[kind]))
