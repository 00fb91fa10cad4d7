"""``oracle``: the task's own reference solution (a Harbor task's ``solution/solve.sh``) as the
agent: the gold check of a dataset. It makes no LLM call; the domain puts the step's
``solution/`` at ``/solution`` only for a harness that ``reads_solution`` (no other agent sees it),
with ``[solution] env`` in ``/solution/.prorl-env``."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from tasks.harnesses.base import HarnessTask, Launch


class OracleConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Oracle:
    name = "oracle"
    config_class = OracleConfig
    reads_solution = True

    def launch(self, task: HarnessTask, config: OracleConfig) -> Launch:
        return Launch(command="if [ -f /solution/.prorl-env ]; then set -a; . /solution/.prorl-env; set +a; fi; "
                              "if [ -f /solution/solve.sh ]; then bash /solution/solve.sh; "
                              "else echo 'oracle: this task has no solution/solve.sh' >&2; exit 2; fi")

    def finish_reason(self, exit_code: int | None, output: str) -> str | None:
        return "exited" if exit_code == 0 else None
