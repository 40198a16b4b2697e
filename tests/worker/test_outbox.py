"""The outbox keeps exactly the commands Redis refused, in order, and sends them first next time;
commands that ran are not sent again; one that can never succeed is dropped (a real Redis)."""
from __future__ import annotations

import redis

from shared import names, protocol
from worker.replies import Outbox

STREAM = "kvgate:test:outbox:stream"
CHANNEL = "kvgate:test:outbox:reply"


def _delta(rid: str, seq: int) -> protocol.Delta:
    return protocol.Delta(request_id=rid, seq=seq, text=f"t{seq}", token_ids=[seq])


def _log(client: redis.Redis, rid: str) -> list[int]:
    return [protocol.decode_reply(raw).seq for raw in client.lrange(names.checkpoint_key(rid), 0, -1)]


def test_a_full_redis_keeps_the_refused_log_appends_in_order_and_sends_the_rest(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.xgroup_create(STREAM, names.CONSUMER_GROUP, id="0", mkstream=True)
    entry_id = client.xadd(STREAM, {"m": b"x"})
    client.xreadgroup(names.CONSUMER_GROUP, "w", {STREAM: ">"})
    listener = client.pubsub()
    listener.subscribe(CHANNEL)
    listener.get_message(timeout=1)
    outbox = Outbox(client, STREAM, "w")
    outbox.reply(CHANNEL, _delta("full-1", 1))
    outbox.reply(CHANNEL, _delta("full-1", 2))
    outbox.finish(entry_id, "full-1")
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", "1")
    try:
        assert outbox.flush() == []
        held = [(name, args[0]) for name, *args in outbox.refused]
        # PUBLISH, EXPIRE, XACK and XDEL need no memory and ran; only the log appends wait
        assert held == [("rpush", names.checkpoint_key("full-1"))] * 2
        assert protocol.decode_replies(listener.get_message(timeout=1)["data"])[1].seq == 2
        assert client.xpending(STREAM, names.CONSUMER_GROUP)["pending"] == 0
        assert outbox.flush() == [] and len(outbox.refused) == 2  # still full: still held
    finally:
        client.config_set("maxmemory", "0")
    outbox.reply(CHANNEL, _delta("full-1", 3))
    outbox.flush()
    assert outbox.refused == []
    assert _log(client, "full-1") == [1, 2, 3]
    assert listener.get_message(timeout=1) is not None  # seq 3 published; 1 and 2 only once
    assert listener.get_message(timeout=0.2) is None
    listener.close()


def test_a_command_that_can_never_succeed_is_dropped_not_held(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.set("kvgate:test:outbox:string", "x")
    outbox = Outbox(client, STREAM, "w")
    outbox.ops.append(("rpush", "kvgate:test:outbox:string", b"y"))  # WRONGTYPE, forever
    outbox.reply(CHANNEL, _delta("drop-1", 1))
    assert outbox.flush() == [] and outbox.refused == []
    assert _log(client, "drop-1") == [1]


def test_an_unreachable_redis_holds_everything(tmp_path):
    from shared.redis_server import RedisServer

    server = RedisServer(data_dir=tmp_path).start()
    try:
        client = redis.Redis.from_url(server.url, socket_connect_timeout=0.5)
        outbox = Outbox(client, STREAM, "w")
        outbox.reply(CHANNEL, _delta("away-1", 1))
        server.stop()
        assert outbox.flush([(STREAM, 4)]) is None
        assert [name for name, *_ in outbox.refused] == ["publish", "rpush", "expire"]
        server.start()
        assert outbox.flush() == [] and outbox.refused == []
        assert _log(client, "away-1") == [1]
    finally:
        server.stop()  # the second start's server too (it outlived the test run before)
