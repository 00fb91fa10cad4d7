"""A handler that opens no sandbox, for measuring the service against bare Celery
(``bench/overhead.py``; loadable where ``PRORL_PLUGIN_PACKAGES`` includes ``prorl_celery.fakes``).
The bare chain it is compared with needs no task of ours: it links Celery's built-in
``celery.accumulate``, so the production app includes nothing for the benchmark."""
from __future__ import annotations

from tasks.handlers.base import AgentHandler


class NoopHandler(AgentHandler):
    """A handler whose stages do nothing and open no sandbox: isolates the cost of the chain,
    the job store and the API from the cost of sandboxes (``data_source: "prorl_celery.fakes.noop:NoopHandler"``)."""

    name = "noop"

    def eval(self, ctx) -> dict:
        return {"reward": 1.0, "resolved": True}
