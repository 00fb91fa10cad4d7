"""The Celery application: ``celery -A prorl_celery worker -Q run`` finds it here."""
from __future__ import annotations

from celery import Celery

app = Celery("prorl_celery", include=["tasks.stages", "tasks.sweep.beat", "tasks.worker_memory"])
app.config_from_object("config.celeryconfig")

from prorl_celery import watchdog  # noqa: E402,F401 - connects the worker's consumer watchdog
from prorl_celery import fdlimit  # noqa: E402,F401 - lifts a worker's open-file limit
from prorl_celery import connections  # noqa: E402,F401 - gives a stage worker its smaller Redis pool
