"""Handlers loaded by dotted path in tests, the way a user plugs in their own."""
from __future__ import annotations

from tasks.handlers.shell import ShellHandler


class BrokenRunHandler(ShellHandler):
    """Opens a sandbox like the shell handler, then its run stage raises."""

    name = "broken-run"

    def run(self, ctx) -> None:
        ctx.sandbox.exec("echo about to fail")
        raise RuntimeError("the scaffold crashed on purpose")
