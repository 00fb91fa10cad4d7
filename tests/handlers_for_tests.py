"""Handlers loaded by dotted path in tests, the way a user plugs in their own."""
from __future__ import annotations

from tasks.handlers.shell import ShellHandler


class BrokenRunHandler(ShellHandler):
    """Opens a sandbox like the shell handler, then its run stage raises."""

    name = "broken-run"

    def run(self, ctx) -> None:
        ctx.sandbox.exec("echo about to fail")
        raise RuntimeError("the scaffold crashed on purpose")


class SlowInitHandler(ShellHandler):
    """Init keeps working (in the sandbox) past a short init budget."""

    def init(self, ctx) -> None:
        super().init(ctx)
        ctx.sandbox.exec("sleep 20", timeout=max(ctx.remaining(), 0.1))
        ctx.check()


class SlowEvalHandler(ShellHandler):
    """Eval keeps working (in the sandbox) past a short eval budget."""

    def eval(self, ctx) -> dict:
        ctx.sandbox.exec("sleep 20", timeout=max(ctx.remaining(), 0.1))
        ctx.check()
        return super().eval(ctx)


class StuckRunHandler(ShellHandler):
    """A scaffold that never looks at its budget: only the sweep can end it."""

    def run(self, ctx) -> None:
        import time

        time.sleep(20)
