"""The cancel listener: a thread subscribed to the cancel channel that queues the request ids it
hears; the serving loop takes them before its next step and aborts those it runs (the engine belongs
to that loop's thread alone). A cancel for a request no worker has started yet is honoured at
admission instead, through the marker key the gateway sets beside it.
"""
from __future__ import annotations

import logging
import queue
import threading

import redis

from shared import names, protocol
from shared.backoff import Backoff
from shared.redis_errors import REDIS_ERRORS, refusal

log = logging.getLogger("kvgate.worker")


class CancelListener:
    def __init__(self, client: redis.Redis, stopping: threading.Event):
        self.client, self.stopping = client, stopping
        self.heard: queue.SimpleQueue[str] = queue.SimpleQueue()

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
                backoff.reset()
                while not self.stopping.is_set():
                    msg = pubsub.get_message(timeout=0.5)
                    if msg and msg["type"] == "message":
                        self._on_message(msg["data"])
            except REDIS_ERRORS as exc:
                log.warning("cancel listener: %s; resubscribing", refusal(exc) or exc)
                self.stopping.wait(backoff.next())
            finally:
                pubsub.close()

    def _on_message(self, raw: bytes) -> None:
        try:
            self.heard.put(protocol.decode_cancel(raw).request_id)
        except ValueError as exc:  # ProtocolError too: one bad message, not a reason to resubscribe
            log.warning("ignored an undecodable cancel: %s", exc)
