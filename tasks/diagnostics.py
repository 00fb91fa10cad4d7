"""Tasks for measuring the service against bare Celery (``bench/overhead.py``)."""
from __future__ import annotations

from prorl_celery.celery_app import app


@app.task(name="prorl.noop")
def noop(*args, **kwargs) -> None:
    """Does nothing: one link of the bare three-link chain the benchmark compares against."""
    return None
