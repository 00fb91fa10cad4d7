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


class GateHandler:
    """A class of the user's own with only init, run and eval (no sandbox): run waits until the
    file named by ``instance["gate"]`` exists."""

    def init(self, ctx) -> None:
        pass

    def run(self, ctx) -> None:
        import os
        import time

        while not os.path.exists(ctx.instance["gate"]):
            ctx.check()
            time.sleep(0.05)

    def eval(self, ctx) -> dict:
        return {"reward": 1.0}


class UserHandler:
    """A user's own scaffold, not derived from anything in the service: loaded by dotted path."""

    name = "user"

    def init(self, ctx) -> None:
        from sandboxes.base import SandboxSpec

        ctx.open_sandbox(SandboxSpec.model_validate(ctx.instance.get("sandbox") or {}))
        ctx.save()

    def run(self, ctx) -> None:
        out = ctx.sandbox.exec(f"echo {int(ctx.instance['x']) * 2}")
        ctx.state["doubled"] = int(out.output.strip())
        ctx.save()

    def eval(self, ctx) -> dict:
        return {"reward": 0.25 if ctx.state["doubled"] == 2 * int(ctx.instance["x"]) else 0.0, "resolved": True}

    def result_fields(self, state: dict) -> dict:
        return {"doubled": state.get("doubled")}

    def on_exception(self, ctx, exc) -> None:
        ctx.close_sandbox()

    def finish(self, ctx) -> None:
        ctx.close_sandbox()


class FailingInitHandler:
    """A class of the user's own (no sandbox) whose init keeps a field in its state, then raises:
    the failed job's result still carries that field."""

    def init(self, ctx) -> None:
        ctx.state["seen"] = "before the crash"
        raise RuntimeError("init crashed on purpose")

    def run(self, ctx) -> None:
        pass

    def eval(self, ctx) -> dict:
        return {"reward": 0.0}

    def result_fields(self, state: dict) -> dict:
        return {"seen": state.get("seen")}


class TwoSandboxHandler(GateHandler):
    """Holds two sandboxes at once, as a Harbor task grading beside its agent does: its own from
    init, and in run a second one (closed before run ends) while it waits for the gate. Says so
    in ``sandbox_need``, which a project's ``max_sandboxes`` counts."""

    def sandbox_need(self, instance: dict) -> int:
        return 2

    def init(self, ctx) -> None:
        from sandboxes.base import SandboxSpec

        ctx.open_sandbox(SandboxSpec.model_validate(ctx.instance.get("sandbox") or {}))
        ctx.save()

    def run(self, ctx) -> None:
        from sandboxes.base import SandboxSpec

        box = ctx.open_aux_sandbox(SandboxSpec.model_validate(ctx.instance.get("sandbox") or {}))
        try:
            super().run(ctx)
        finally:
            ctx.close_aux_sandbox(box)

    def finish(self, ctx) -> None:
        ctx.close_sandbox()

    def on_exception(self, ctx, exc) -> None:
        ctx.close_sandbox()
