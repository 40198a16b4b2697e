"""The cancel listener: a thread subscribed to the cancel channel that queues the request ids it
hears; the serving loop takes them before its next step and aborts those it runs (the engine belongs
to that loop's thread alone). A cancel for a request no worker has started yet is honoured at
admission instead: the serving loop keeps the ids it heard for requests it was not running
(`HeardCancels`), which answer for an entry added to the stream while the listener was subscribed;
an older entry, a redelivered one, or any while the listener is down, reads the marker key the
gateway sets before it publishes (a round trip per admission, which the heard ids save).
"""
from __future__ import annotations

import logging
import queue
import threading
import time

import redis

from shared import names, protocol
from shared.backoff import Backoff
from shared.redis_errors import REDIS_ERRORS, refusal

log = logging.getLogger("kvgate.worker")


class CancelListener:
    def __init__(self, client: redis.Redis, stopping: threading.Event):
        self.client, self.stopping = client, stopping
        self.heard: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.since: float | None = None  # time.time() since when it has been subscribed; None: not now

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._listen, daemon=True, name="cancels")
        thread.start()
        return thread

    def take(self) -> list[str]:
        """The request ids heard since the last take."""
        ids = []
        while not self.heard.empty():
            ids.append(self.heard.get_nowait())
        return ids

    def _listen(self) -> None:
        backoff = Backoff(0.1, 2.0)
        while not self.stopping.is_set():
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(names.CANCEL_CHANNEL)
                self.since = time.time()  # SUBSCRIBE was sent; SUBSCRIBED_MARGIN_S covers its landing
                backoff.reset()
                while not self.stopping.is_set():
                    msg = pubsub.get_message(timeout=0.5)
                    if msg and msg["type"] == "message":
                        self._on_message(msg["data"])
            except REDIS_ERRORS as exc:
                log.warning("cancel listener: %s; resubscribing", refusal(exc) or exc)
                self.stopping.wait(backoff.next())
            finally:
                self.since = None
                pubsub.close()

    def _on_message(self, raw: bytes) -> None:
        try:
            self.heard.put(protocol.decode_cancel(raw).request_id)
        except ValueError as exc:  # ProtocolError too: one bad message, not a reason to resubscribe
            log.warning("ignored an undecodable cancel: %s", exc)


SUBSCRIBED_MARGIN_S = 5.0  # Redis's clock against this worker's, and a SUBSCRIBE's time to land
HEARD_FOR_S = 600.0  # as long as the gateway's marker lives (gateway/dispatch.py, CANCEL_MARK_TTL_S)
MAX_HEARD = 100_000  # ids kept at most (every worker hears every model's cancels)


class HeardCancels:
    """The cancels the serving loop heard for requests it was not running, kept HEARD_FOR_S (at most
    MAX_HEARD, oldest dropped first). They answer "was this entry cancelled before it started?"
    for an entry added at least SUBSCRIBED_MARGIN_S after the listener subscribed (and after the
    heard time of any id dropped early): the gateway publishes a request's cancel only after
    its XADD, so the listener heard every cancel such an entry can have."""

    def __init__(self, listener: CancelListener, keep_s: float = HEARD_FOR_S, max_ids: int = MAX_HEARD):
        self.listener, self.keep_s, self.max_ids = listener, keep_s, max_ids
        self.ids: dict[str, float] = {}  # request id -> when heard, oldest first
        self.complete_since = 0.0  # every cancel heard since then is still in `ids`

    def add(self, request_id: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self.ids[request_id] = now
        while self.ids:
            oldest, heard = next(iter(self.ids.items()))
            if len(self.ids) <= self.max_ids and now - heard <= self.keep_s:
                break
            del self.ids[oldest]
            self.complete_since = max(self.complete_since, heard)

    def answers_for(self, added_at: float) -> bool:
        """Whether the ids kept here say for sure if an entry added at `added_at` (Redis's clock,
        seconds) was cancelled."""
        since = self.listener.since
        return since is not None and added_at - SUBSCRIBED_MARGIN_S >= max(since, self.complete_since)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.ids


def added_at(entry_id: bytes | str) -> float:
    """When Redis added a stream entry, from its id (`<milliseconds>-<sequence>`), in seconds."""
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.split("-", 1)[0]) / 1000
