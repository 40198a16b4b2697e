"""The Celery app of kvgate's services: periodic checks and background jobs, with Redis (the one
every process already meets at) as the broker. Task modules are listed in TASK_MODULES, periodic
ones in the beat schedule; each task is a thin wrapper around a plain function tests call directly.

Run through the console script: `kvgate celery worker` and `kvgate celery beat` (`kvgate up` starts
both).
"""
from __future__ import annotations

from celery import Celery, signals

from shared import logs, names
from shared.batches import BATCH_QUEUE, BATCH_TASK
from shared.redis_client import broker_options, broker_url
from shared.settings import ServicesSettings

TASK_MODULES = ["services.canary_tasks", "services.batch_tasks", "services.maintenance_tasks"]


def create_app(settings: ServicesSettings | None = None) -> Celery:
    settings = settings or ServicesSettings()
    app = Celery("kvgate", broker=broker_url(settings), include=TASK_MODULES)
    app.conf.update(
        broker_transport_options={"global_keyprefix": names.CELERY_PREFIX},
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,  # a long Redis outage is waited out, never fatal
        **broker_options(settings),  # TLS verified, like every Redis connection
        task_ignore_result=True,
        task_routes={BATCH_TASK: {"queue": BATCH_QUEUE}},  # batch runs: their own queue
        beat_schedule={
            "canary-check": {"task": "kvgate.canary.check", "schedule": settings.canary_check_s,
                             # a check that could not run in its own period is superseded by the next
                             "options": {"expires": settings.canary_check_s}},
            **{name: {"task": task, "schedule": settings.maintenance_s,
                      "options": {"expires": settings.maintenance_s}}
               for name, task in (("reap-workers", "kvgate.maintenance.reap_workers"),
                                  ("expire-files", "kvgate.maintenance.expire_files"),
                                  ("fold-usage", "kvgate.maintenance.fold_usage"),
                                  ("tend-batches", "kvgate.batches.tend"))},
        },
    )
    app.kvgate_settings = settings
    return app


@signals.setup_logging.connect
def _json_logs(loglevel=None, **_) -> None:
    """Celery's worker and beat log JSON lines like every kvgate process (instead of Celery's own
    format); each task's lines carry its task id as their request id."""
    logs.setup(loglevel or ServicesSettings().log_level, "services")


@signals.task_prerun.connect
def _bind_task(task_id=None, **_) -> None:
    logs.bind_request(f"task-{task_id}")


@signals.task_postrun.connect
def _unbind_task(**_) -> None:
    logs.unbind_request()


app = create_app()
