"""``mini_swe_agent``: SWE-agent's mini-swe-agent (PyPI ``mini-swe-agent``), its ``mini`` command
with the default (non-interactive) agent and its local environment, so its bash commands run in
the sandbox it was started in; its model is LiteLLM's OpenAI chat client aimed at the gateway."""
from __future__ import annotations

import json
import os
import re

from pydantic import BaseModel, ConfigDict, Field

from tasks.harnesses.base import HARNESS_DIR, HarnessTask, Launch, env_prefix, gateway_env

_STATUS = re.compile(r'"exit_status": "([A-Za-z]+)"')
EXIT_GRACE_S = 10
EXIT_STATUS = {"Submitted": "submitted", "LimitsExceeded": "step_limit", "TimeExceeded": "wall_time",
               "RepeatedFormatError": "format_error"}


class MiniSweAgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    step_limit: int = Field(50, ge=1, description="Agent steps (each one LLM call).")
    command_timeout_s: int = Field(60, ge=1, description="Timeout of each bash command it runs.")
    config: str = Field("mini.yaml", description="Its built-in config file to start from.")


def mini_binary() -> str:
    """``mini`` from the operator's harness directory (``scripts/install-harnesses.sh``), else PATH."""
    root = os.environ.get("PRORL_HARNESS_ROOT", "/opt/prorl-harnesses")
    installed = os.path.join(root, "mini-swe-agent", "bin", "mini")
    return installed if os.path.exists(installed) else "mini"


class MiniSweAgent:
    name = "mini_swe_agent"
    config_class = MiniSweAgentConfig

    def launch(self, task: HarnessTask, config: MiniSweAgentConfig) -> Launch:
        ours = {"agent": {"step_limit": task.max_calls or config.step_limit, "cost_limit": 0,
                          "wall_time_limit_seconds": int(task.wall_s), "confirm_exit": False},
                "model": {"model_name": f"openai/{task.model}", "cost_tracking": "ignore_errors",
                          "model_kwargs": {"api_base": f"{task.base_url}/v1", "api_key": task.api_key,
                                           "drop_params": True}},
                "environment": {"timeout": config.command_timeout_s}}
        env = {**gateway_env(task), "MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors",
               "MSWEA_SILENT_STARTUP": "1", "MSWEA_GLOBAL_CONFIG_DIR": HARNESS_DIR, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        command = (f"{env_prefix(env)} {mini_binary()} -y --exit-immediately --agent-class default "
                   f"-c {config.config} -c {HARNESS_DIR}/prorl.yaml -o {HARNESS_DIR}/trajectory.json "
                   f"-t \"$(cat {HARNESS_DIR}/task.txt)\"")
        # its exit status is in the trajectory it saves, not in its exit code: print it last. Once
        # the trajectory says it finished, it has EXIT_GRACE_S to exit (LiteLLM's exit handlers
        # were seen to hang a finished run on a loaded node)
        traj, done = f"{HARNESS_DIR}/trajectory.json", "'\"exit_status\": \"[A-Za-z][A-Za-z]*\"'"
        command = (f"( {command} & pid=$!; while kill -0 $pid 2>/dev/null; do "
                   f"if grep -q {done} {traj} 2>/dev/null; then "
                   f"for i in $(seq {EXIT_GRACE_S * 4}); do kill -0 $pid 2>/dev/null || break; sleep 0.25; done; "
                   f"kill -9 $pid 2>/dev/null; break; fi; sleep 0.5; done; wait $pid; rc=$?; "
                   f"grep -ho {done} {traj} 2>/dev/null | tail -1; exit $rc )")
        return Launch(files={"prorl.yaml": json.dumps(ours), "task.txt": task.instruction}, command=command)

    def finish_reason(self, exit_code: int | None, output: str) -> str | None:
        found = _STATUS.findall(output)
        if not found:
            return None
        return EXIT_STATUS.get(found[-1], found[-1].lower())

