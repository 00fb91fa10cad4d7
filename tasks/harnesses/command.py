"""``command``: a team's own harness as a command line, run in the sandbox's shell.

It finds its gateway in the usual variables (``OPENAI_BASE_URL``/``OPENAI_API_KEY``,
``ANTHROPIC_BASE_URL``/``ANTHROPIC_API_KEY``, ``PRORL_GATEWAY_URL``/``PRORL_GATEWAY_KEY``,
``PRORL_MODEL``) and its task in ``$PRORL_TASK_FILE``; exit 0 means it finished."""
from __future__ import annotations

import shlex

from pydantic import BaseModel, ConfigDict, Field

from tasks.harnesses.base import HARNESS_DIR, HarnessTask, Launch, env_prefix, gateway_env


class CommandConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    command: str = Field(min_length=1, max_length=8192, description="The command line (bash), started in "
                                                                     "the task's working directory.")


class CommandHarness:
    name = "command"
    config_class = CommandConfig

    def launch(self, task: HarnessTask, config: CommandConfig) -> Launch:
        env = env_prefix({**gateway_env(task), "PRORL_TASK_FILE": f"{HARNESS_DIR}/task.txt"})
        return Launch(files={"task.txt": task.instruction}, command=f"{env} bash -c {shlex.quote(config.command)}")

    def finish_reason(self, exit_code: int | None, output: str) -> str | None:
        return "exited" if exit_code == 0 else None
