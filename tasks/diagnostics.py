"""Tasks for measuring the service against bare Celery (``bench/overhead.py``)."""
from __future__ import annotations

from prorl_celery.celery_app import app
from tasks.handlers.base import AgentHandler


@app.task(name="prorl.noop")
def noop(*args, **kwargs) -> None:
    """Does nothing: one link of the bare three-link chain the benchmark compares against."""
    return None


class NoopHandler(AgentHandler):
    """A handler whose stages do nothing and open no sandbox: isolates the cost of the chain,
    the job store and the API from the cost of sandboxes (``data_source: "tasks.diagnostics:NoopHandler"``)."""

    name = "noop"

    def eval(self, ctx) -> dict:
        return {"reward": 1.0, "resolved": True}
