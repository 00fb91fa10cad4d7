"""``replay``: a kept result's final workspace diff applied as the agent (``"patch": "..."``), so
that today's grader grades what an earlier rollout left (``prorl-celery rescore``). It makes no
LLM call; the patch goes in as a file, not on the command line."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from tasks.harnesses.base import HARNESS_DIR, HarnessTask, Launch


class ReplayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    patch: str = Field(max_length=64 * 1024 * 1024, description="A git diff of the working tree, applied in the "
                                                                 "task's working directory.")


class Replay:
    name = "replay"
    config_class = ReplayConfig

    def launch(self, task: HarnessTask, config: ReplayConfig) -> Launch:
        command = (f'if [ -s "{HARNESS_DIR}/patch.diff" ]; then git apply --whitespace=nowarn '
                   f'"{HARNESS_DIR}/patch.diff" || patch -p1 --forward < "{HARNESS_DIR}/patch.diff"; fi')
        return Launch(files={"patch.diff": config.patch}, command=command)

    def finish_reason(self, exit_code: int | None, output: str) -> str | None:
        return "exited" if exit_code == 0 else None
