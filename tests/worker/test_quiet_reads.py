"""A flush with nothing to send reads the lanes at most every READ_EVERY_S, counting the idle
worker's blocking read: the first step of a whole answer (whose replies are held) makes no round
trip of its own right after the read that brought it. On the session's real Redis."""
from __future__ import annotations

import redis

from shared import protocol
from shared.settings import WorkerSettings
from tests.conftest import wire_entry
from worker import consumer as consumer_module
from worker.consumer import StreamConsumer


def _consumer(redis_server) -> StreamConsumer:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    c = StreamConsumer(client, WorkerSettings(model="m", served_name="demo", worker_id="w-quiet"))
    c.ensure_groups()
    return c


def test_the_blocking_read_counts_as_a_read_for_a_flush_with_nothing_to_send(redis_server, monkeypatch):
    monkeypatch.setattr(consumer_module, "READ_EVERY_S", 60.0)  # "just now", however slow the host
    c = _consumer(redis_server)
    assert c.next_reads(4, quiet=True) == [(c.stream, 4), (c.batch_stream, 4)]  # never read yet
    c.client.xadd(c.stream, {protocol.ENTRY_FIELD: protocol.encode(wire_entry("r1", "ch", streamed=False))})
    c.take(4, idle=True, known=set)
    assert (taken := c.next()) is not None and protocol.decode_entry(taken.raw).request_id == "r1"
    assert c.next_reads(4, quiet=True) == []  # the blocking read was the read
    assert c.next_reads(4, quiet=False) == [(c.stream, 4), (c.batch_stream, 4)]  # replies go out: read along
    monkeypatch.setattr(consumer_module, "READ_EVERY_S", 0.0)
    assert c.next_reads(4, quiet=True) == [(c.stream, 4), (c.batch_stream, 4)]  # its time has come


def test_a_flush_that_read_is_the_last_read_and_an_empty_one_is_not(redis_server, monkeypatch):
    monkeypatch.setattr(consumer_module, "READ_EVERY_S", 60.0)
    c = _consumer(redis_server)
    c.received([], [])  # a flush that read nothing
    assert c.next_reads(2, quiet=True) == [(c.stream, 2), (c.batch_stream, 2)]
    c.received([(c.stream, 2)], [None])  # one that read the interactive lane (empty)
    assert c.next_reads(2, quiet=True) == []
