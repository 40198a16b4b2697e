"""The refusals Redis makes for a while are told apart from errors waiting will not fix, whether
they come from a plain command, a pipeline or inside a Lua script (errors from a real server)."""
from __future__ import annotations

import time

import pytest
import redis
from redis._parsers import _RESP2Parser

from shared.redis_errors import refusal
from shared.redis_server import RedisServer, free_port


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
    gone = redis.Redis(port=free_port(), socket_connect_timeout=0.5)  # nothing listens there
    assert refusal(_error(gone.ping)) == "Redis is unreachable"


def test_errors_waiting_cannot_fix_are_not_refusals(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.set("kvgate:test:string", "x")
    wrongtype = _error(lambda: client.rpush("kvgate:test:string", "y"))
    nogroup = _error(lambda: client.xreadgroup("no-group", "me", {"kvgate:test:nostream": ">"}))
    busygroup_text = _parsed("BUSYGROUP Consumer Group name already exists")
    for exc in (wrongtype, nogroup, busygroup_text):
        assert refusal(exc) is None, exc
