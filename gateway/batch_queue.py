"""Hands a new batch to the Celery runner: one task message on the batch queue. Only the task's
name and queue are shared with services/, so the gateway imports none of the services' code.
If the message cannot be sent, the batch still exists: the maintenance beat starts every active
batch that no runner holds."""
from __future__ import annotations

import asyncio
import logging

from celery import Celery

from shared import names
from shared.batches import BATCH_QUEUE, BATCH_TASK

log = logging.getLogger("kvgate.gateway")


class BatchQueue:
    def __init__(self, broker_url: str, options: dict | None = None):
        self.celery = Celery("kvgate-gateway", broker=broker_url)
        self.celery.conf.update(options or {})  # TLS of the broker connection
        self.celery.conf.broker_transport_options = {"global_keyprefix": names.CELERY_PREFIX}

    async def submit(self, batch_id: str) -> None:
        """Kombu publishes synchronously: in a thread, so the event loop never waits on it."""
        try:
            await asyncio.to_thread(self.celery.send_task, BATCH_TASK, args=[batch_id],
                                    queue=BATCH_QUEUE)
        except Exception as exc:
            log.warning("batch %s not queued (%s); maintenance will start it", batch_id,
                        type(exc).__name__)
