"""Celery tasks of the canary analysis (the logic is in services/canary.py)."""
from __future__ import annotations

from services.celery_app import app
from services.canary import run_checks


@app.task(name="kvgate.canary.check")
def check() -> dict[str, str]:
    """Every route with a canary on trial: analyse, then roll back, advance, promote or hold."""
    return run_checks(app.kvgate_settings)
