"""Handlers that meet real faults of the real sandbox host (tests/tasks/test_retries.py)."""
from __future__ import annotations

from tasks.handlers.shell import ShellHandler


class SandboxVanishesHandler(ShellHandler):
    """Its run stage closes its own sandbox through the host (as a host restart or the sweep
    would make it vanish) and then uses it: the host answers 404 sandbox_gone, every attempt."""

    def run(self, ctx) -> None:
        ctx.sandbox.exec("echo before")
        ctx.sandbox.close()
        ctx.sandbox.exec("echo after")


class FailingGraderHandler(ShellHandler):
    """The commands run; the grader itself raises (a fault of the task, not of the service)."""

    def eval(self, ctx) -> dict:
        raise ValueError("the grader crashed on this instance")
