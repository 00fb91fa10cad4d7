"""A handler that opens no sandbox, for measuring the service against bare Celery
(``bench/overhead.py``; loadable where ``PRORL_PLUGIN_PACKAGES`` includes ``prorl_celery.fakes``).
The bare chain it is compared with needs no task of ours: it links Celery's built-in
``celery.accumulate``, so the production app includes nothing for the benchmark.

It is a plain class, as a handler named by dotted path may be: the hooks it leaves out
(``check_instance``, ``result_fields``, ...) are :class:`tasks.handlers.base.AgentHandler`'s, added
when the handler is loaded (:func:`tasks.handlers.check.conform`), so nothing here imports ``tasks``."""
from __future__ import annotations

from typing import Any


class NoopHandler:
    """A handler whose stages do nothing and open no sandbox: isolates the cost of the chain,
    the job store and the API from the cost of sandboxes (``data_source: "prorl_celery.fakes.noop:NoopHandler"``)."""

    name = "noop"

    def init(self, ctx: Any) -> None:
        """Nothing to prepare."""

    def run(self, ctx: Any) -> None:
        """Nothing to roll out."""

    def eval(self, ctx: Any) -> dict:
        return {"reward": 1.0, "resolved": True}
