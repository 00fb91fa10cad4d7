"""Tasks for measuring the service against bare Celery (``bench/overhead.py``)."""
from __future__ import annotations

from prorl_celery.celery_app import app


@app.task(name="prorl.noop")
def noop(*args, **kwargs) -> None:
    """Does nothing: one link of the bare three-link chain the benchmark compares against."""
    return None


class NoopHandler:
    """A handler whose stages do nothing and open no sandbox: isolates the cost of the chain,
    the job store and the API from the cost of sandboxes (``data_source: "tasks.diagnostics:NoopHandler"``)."""

    name = "noop"

    def init(self, ctx) -> None: ...

    def run(self, ctx) -> None: ...

    def eval(self, ctx) -> dict:
        return {"reward": 1.0, "resolved": True}

    def result_fields(self, state: dict) -> dict:
        return {}

    def on_exception(self, ctx, exc: BaseException) -> None: ...

    def finish(self, ctx) -> None: ...
