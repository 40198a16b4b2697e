"""Celery beat's maintenance tasks (the logic is in services/maintenance.py)."""
from __future__ import annotations

import asyncio


from services.celery_app import app
from services.maintenance import reap_workers as _reap_workers
from shared.files import FileStore
from shared.redis_client import async_client
from shared.usage import fold


def _with_redis(fn):
    async def once():
        client = async_client(app.kvgate_settings, socket_connect_timeout=2, socket_timeout=5)
        try:
            return await fn(client)
        finally:
            await client.aclose()
    return asyncio.run(once())


@app.task(name="kvgate.maintenance.reap_workers")
def reap_workers() -> dict[str, int]:
    """Registry members and stream consumers of workers that are gone."""
    return _with_redis(_reap_workers)


@app.task(name="kvgate.maintenance.expire_files")
def expire_files() -> int:
    """Files past their expiry: deleted, bytes, record and quota entry; and what uploads and
    batch creations cut short by a dead gateway left (partial files, quota holds)."""
    s = app.kvgate_settings

    async def expire(redis) -> int:
        files = FileStore(redis, s.data_dir, s.file_retention_s)
        expired = await files.expire()
        await files.quota.prune()
        return expired
    return _with_redis(expire)


@app.task(name="kvgate.maintenance.fold_usage")
def fold_usage() -> list[str]:
    """Usage of the days that are over, rolled up into one hash per day; the days folded."""
    return _with_redis(fold)
