"""A cancel that comes before its request starts: the worker honours the cancels it heard for an
entry added while its listener was subscribed, without reading the marker key (a round trip per
admission saved), and reads the marker for any other entry. `HeardCancels` on its own, then one
real worker process on a real Redis, fed by XADD and cancelled as a gateway would."""
from __future__ import annotations

import time

import pytest

from shared import names, protocol
from tests.integration.test_faults import Cluster
from tests.worker.test_wire_schemas import Channel, entry, orphan, xadd
from shared.settings import WorkerSettings
from worker.cancels import SUBSCRIBED_MARGIN_S, HeardCancels, added_at


HEARTBEAT_S = WorkerSettings.model_fields["heartbeat_s"].default


class Listener:
    since: float | None = None


def test_heard_ids_answer_only_for_entries_added_well_after_the_subscription():
    listener = Listener()
    heard = HeardCancels(listener)
    assert not heard.answers_for(time.time()), "not subscribed: the marker must be read"
    listener.since = 1000.0
    assert not heard.answers_for(1000.0 + SUBSCRIBED_MARGIN_S - 0.1)
    assert heard.answers_for(1000.0 + SUBSCRIBED_MARGIN_S)
    heard.add("r1", now=1010.0)
    assert "r1" in heard and "r2" not in heard


def test_dropping_heard_ids_moves_what_they_answer_for():
    listener = Listener()
    listener.since = 0.0
    heard = HeardCancels(listener, keep_s=100.0, max_ids=2)
    for i, at in enumerate((10.0, 20.0, 30.0)):  # the third drops the first (max_ids)
        heard.add(f"r{i}", now=at)
    assert "r0" not in heard and heard.complete_since == 10.0
    assert not heard.answers_for(10.0 + SUBSCRIBED_MARGIN_S - 1) and heard.answers_for(10.0 + SUBSCRIBED_MARGIN_S)
    heard.add("r3", now=125.0)  # r1 (20) and r2 (30)... r1 is older than keep_s
    assert "r1" not in heard and "r2" in heard and heard.complete_since == 20.0


def test_an_entry_id_says_when_redis_added_it():
    assert added_at(b"1796209037123-4") == pytest.approx(1796209037.123)


def cancel_before_pickup(cluster: Cluster, request_id: str) -> None:
    """What a gateway does when its client leaves (gateway/dispatch.py `_cancel`): the marker, then
    the message; then time for the worker's loop to take the message."""
    cluster.client.set(names.cancelled_key(request_id), "client_gone", ex=600)
    publish_cancel(cluster, request_id)


def publish_cancel(cluster: Cluster, request_id: str) -> None:
    message = protocol.encode(protocol.Cancel(request_id=request_id, reason="client_gone"),
                              version=protocol.OLDEST_SCHEMA)
    assert cluster.client.publish(names.CANCEL_CHANNEL, message) >= 1, "no worker listens"
    time.sleep(0.3)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    c = Cluster(tmp_path_factory.mktemp("heard"), tiny_model_dir)
    c.start_worker("w1")
    time.sleep(SUBSCRIBED_MARGIN_S + 0.5)  # entries from now on are the listener's to answer
    yield c
    c.close()


def _exists_calls(cluster: Cluster) -> int:
    return int(cluster.client.info("commandstats").get("cmdstat_exists", {}).get("calls", 0))


def _admitted(cluster: Cluster) -> int:
    return cluster.fresh_info("w1")["requests_admitted"]


def test_a_heard_cancel_is_honoured_without_a_round_trip(cluster):
    ch = Channel(cluster, "heard")
    xadd(cluster, protocol.encode(entry("warm", ch.name, prompt="hi")))
    assert ch.raw_replies("warm")[-1]["type"] == "done"
    exists_before = _exists_calls(cluster)
    publish_cancel(cluster, "heard-only")  # no marker: only the message can stop it
    xadd(cluster, protocol.encode(entry("heard-only", ch.name, prompt="hi")))
    xadd(cluster, protocol.encode(entry("runs", ch.name, prompt="Hello there")))
    assert ch.raw_replies("runs")[-1]["type"] == "done"
    assert "heard-only" not in ch.got, "a cancelled entry must never start"
    assert _exists_calls(cluster) == exists_before, "no admission read the marker"
    deadline = time.monotonic() + 10
    while cluster.client.xlen(names.request_stream("demo", "v1")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.client.xlen(names.request_stream("demo", "v1")) == 0, "the cancelled entry was acknowledged"


def test_a_redelivered_entry_reads_the_marker(cluster):
    """An entry taken over from a dead worker may have been cancelled before this worker listened
    (or while the entry waited): the marker says, for it and for an entry older than the listener's
    subscription (`answers_for` above)."""
    ch = Channel(cluster, "orphans")
    cluster.client.set(names.cancelled_key("orphan-marked"), "client_gone", ex=600)
    admitted = _admitted(cluster)
    orphan(cluster, protocol.encode(entry("orphan-marked", ch.name, prompt="hi")))
    stream = names.request_stream("demo", "v1")
    deadline = time.monotonic() + 20  # claimed at the worker's next heartbeat, then acknowledged
    while cluster.client.xpending(stream, names.CONSUMER_GROUP)["pending"]:
        assert time.monotonic() < deadline, "the orphan was never taken"
        time.sleep(0.1)
    xadd(cluster, protocol.encode(entry("after", ch.name, prompt="Hello there")))
    assert ch.raw_replies("after")[-1]["type"] == "done"
    assert "orphan-marked" not in ch.got, "the marked orphan must never start (no cancel was heard for it)"
    deadline = time.monotonic() + 10
    while _admitted(cluster) < admitted + 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(2 * HEARTBEAT_S)
    assert _admitted(cluster) == admitted + 1  # "after" alone
