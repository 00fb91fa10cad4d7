"""Stand-ins for measuring the service against bare Celery (``bench/overhead.py``): a no-op task for
the bare chain and a handler that opens no sandbox (loadable where ``PRORL_PLUGIN_PACKAGES``
includes ``prorl_celery.fakes``)."""
from __future__ import annotations

from prorl_celery.celery_app import app
from tasks.handlers.base import AgentHandler


@app.task(name="prorl.noop")
def noop(*args, **kwargs) -> None:
    """Does nothing: one link of the bare three-link chain the benchmark compares against."""
    return None


class NoopHandler(AgentHandler):
    """A handler whose stages do nothing and open no sandbox: isolates the cost of the chain,
    the job store and the API from the cost of sandboxes (``data_source: "prorl_celery.fakes.noop:NoopHandler"``)."""

    name = "noop"

    def eval(self, ctx) -> dict:
        return {"reward": 1.0, "resolved": True}
