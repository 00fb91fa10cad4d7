"""The handler interface: one task domain's init, run and eval stages."""
from __future__ import annotations

from typing import Any

from tasks.context import StageContext
from tasks.handlers.instances import check_sandbox


class AgentHandler:
    """A task domain. Subclass it, or point ``instance["data_source"]`` at any class with
    ``init``, ``run`` and ``eval`` by dotted path (``"my_pkg.my_module:MyHandler"``); the hooks
    it leaves out (``result_fields``, ``on_exception``, ``finish``) are the ones below.

    Each stage may run on a different worker and node: whatever a later stage needs goes into
    ``ctx.state`` (saved in the job store) or into the sandbox.
    """

    name: str = "base"

    def check_instance(self, instance: dict[str, Any]) -> None:
        """Refuse, at submission (before anything is stored), what the operator's policy does
        not allow and the API can tell: by default the ``sandbox`` block's runtime and image
        (:func:`tasks.handlers.instances.check_sandbox`). Raises
        :class:`~prorl_celery.errors.PolicyDenied` naming the field. The API calls this for a
        handler named by dotted path; a built-in handler's check is registered in
        ``tasks/handlers/__init__.py`` too, so the API checks it without importing the handler."""
        check_sandbox(instance)

    def sandbox_need(self, instance: dict[str, Any]) -> int:
        """The most sandboxes a job of ``instance`` holds at once, from its init to its end: what
        its project's ``max_sandboxes`` counts (:mod:`prorl_celery.quotas`), computed at
        submission. 1 by default: the job's own sandbox (one a grader opens after closing it, as
        ``code`` and ``swe`` do, replaces it). A handler that opens a second one while the first
        lives says so here (``harbor``: its sidecars and a separate verifier's)."""
        return 1

    def init(self, ctx: StageContext) -> None:
        """Prepare the job: open its sandbox, put the task's files in place."""

    def run(self, ctx: StageContext) -> None:
        """Do the rollout; call ``ctx.save()`` after each step so a redelivered run resumes."""

    def eval(self, ctx: StageContext) -> dict[str, Any]:
        """Score the rollout. Returns result fields, at least ``reward`` and ``resolved``."""
        return {"reward": 0.0, "resolved": False}

    def result_fields(self, state: dict[str, Any]) -> dict[str, Any]:
        """Fields of the result derivable from the saved state; used for partial results too."""
        return {}

    def on_exception(self, ctx: StageContext, exc: BaseException) -> None:
        """Called when a stage raised; by default the sandbox is closed."""
        ctx.close_sandbox()

    def finish(self, ctx: StageContext) -> None:
        """Called after eval succeeded; by default the sandbox is closed."""
        ctx.close_sandbox()
