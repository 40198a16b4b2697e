"""Celery tasks of batch jobs (the logic is in services/batch.py and services/maintenance.py)."""
from __future__ import annotations

import asyncio


from services.batch import run_batch
from services.celery_app import app
from services.maintenance import tend_batches
from shared.batches import BATCH_QUEUE, BATCH_TASK
from shared.redis_client import async_client


@app.task(name=BATCH_TASK)
def run(batch_id: str) -> str:
    """Run one batch to its end (or until it is cancelled or expires), then hand a free slot on."""
    outcome = run_batch(app.kvgate_settings, batch_id)
    if not outcome.startswith("waiting"):
        tend()
    return outcome


@app.task(name="kvgate.batches.tend")
def tend() -> list[str]:
    """Start a runner for every active batch that none holds (new, waiting, or orphaned)."""
    async def once() -> list[str]:
        client = async_client(app.kvgate_settings, socket_connect_timeout=2, socket_timeout=5)
        try:
            return await tend_batches(client, start)
        finally:
            await client.aclose()
    return asyncio.run(once())


def start(batch_id: str) -> None:
    app.send_task(BATCH_TASK, args=[batch_id], queue=BATCH_QUEUE)
