"""The diagnostic ``shell`` domain: run a list of commands in one sandbox shell session.

Instance: ``{"data_source": "shell", "commands": ["...", ...], "sandbox"?: {...},
"timeout"?: seconds per command}``. Reward 1.0 when every command exited 0, else 0.0.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from config.settings import get_settings
from sandboxes.base import SandboxSpec
from sandboxes.policy import handler_spec
from tasks.context import StageContext
from tasks.handlers.base import AgentHandler
from tasks.handlers.instances import check_no_agent


class ShellInstance(BaseModel):
    model_config = ConfigDict(extra="ignore")

    commands: list[str] = Field(default_factory=list, description="Commands, run in order.")
    sandbox: SandboxSpec = Field(default_factory=SandboxSpec, description="Where they run.")
    timeout: float | None = Field(None, description="Per-command timeout, seconds.")


class ShellHandler(AgentHandler):
    name = "shell"

    def check_instance(self, instance: dict[str, Any]) -> None:
        """Also: no ``agent`` block (this domain runs none; :func:`~tasks.handlers.instances.check_no_agent`)."""
        check_no_agent(instance)

    def init(self, ctx: StageContext) -> None:
        ShellInstance.model_validate(ctx.instance)
        ctx.open_sandbox(handler_spec({}, ctx.instance.get("sandbox")))  # its handle is stored by the open
        ctx.state["steps"] = []  # stored by the stage's end, which writes the state (no save of its own)

    def run(self, ctx: StageContext) -> None:
        instance = ShellInstance.model_validate(ctx.instance)
        steps: list[dict[str, Any]] = ctx.state.setdefault("steps", [])
        if ctx.resumed:
            ctx.sandbox.interrupt()  # whatever the dead worker started may still be running
        per_command = instance.timeout or get_settings().action_timeout_s
        for command in instance.commands[len(steps):]:
            ctx.check()
            out = ctx.sandbox.exec(command, timeout=min(per_command, max(ctx.remaining(), 0.1)))
            steps.append({"command": command, "exit_code": out.exit_code, "output": out.output,
                          "timed_out": out.timed_out})
            ctx.save()
        ctx.check()

    def eval(self, ctx: StageContext) -> dict[str, Any]:
        steps = ctx.state.get("steps", [])
        ok = all(step["exit_code"] == 0 for step in steps)
        return {"reward": 1.0 if ok else 0.0, "resolved": ok, "finish_reason": "done"}

    def result_fields(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"steps": state.get("steps", [])}
