"""The harness family in process: the registry, the conformance check, what each harness launches."""
from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict

from prorl_celery.errors import UnknownPlugin
from tasks.harnesses import HARNESSES, is_harness_agent
from tasks.harnesses.base import HarnessTask
from tasks.harnesses.check import check_harness

pytestmark = pytest.mark.unit  # in process (tests/unit_tier.py)

TASK = HarnessTask(instruction="Fix it; don't break 'quotes'.", base_url="http://127.0.0.1:9", api_key="k3y",
                   model="m", max_calls=3, wall_s=30)


def test_every_registered_harness_conforms_and_unknown_names_list_the_known():
    for name in HARNESSES.entries:
        check_harness(HARNESSES.load(name))
    with pytest.raises(UnknownPlugin, match="command, mini-swe-agent, mini_swe_agent"):
        HARNESSES.load("claude_kode")
    with pytest.raises(UnknownPlugin, match="allowed packages"):
        HARNESSES.load("os:system")


def test_the_check_names_what_does_not_conform():
    class Loose(BaseModel):
        pass

    class Bad:
        name = "bad"
        config_class = Loose

        def launch(self, task):
            return None

    with pytest.raises(UnknownPlugin, match="extra='forbid'.*launch must take .task, config.*no finish_reason"):
        check_harness(Bad)

    class Good:
        name = "good"

        class config_class(BaseModel):
            model_config = ConfigDict(extra="forbid")

        def launch(self, task, config):
            return None

        def finish_reason(self, exit_code, output):
            return None

    check_harness(Good)


def test_launches_carry_the_gateway_and_the_task_as_files():
    mini = HARNESSES.load("mini_swe_agent")()
    launch = mini.launch(TASK, mini.config_class())
    assert "task.txt" in launch.files and launch.files["task.txt"] == TASK.instruction
    assert '"api_base": "http://127.0.0.1:9/v1"' in launch.files["prorl.yaml"] and "k3y" in launch.files["prorl.yaml"]
    assert '"step_limit": 3' in launch.files["prorl.yaml"]
    assert mini.finish_reason(0, 'noise\n"exit_status": "Submitted"') == "submitted"
    assert mini.finish_reason(1, '"exit_status": "LimitsExceeded"') == "step_limit"
    assert mini.finish_reason(1, "Traceback ...") is None
    command = HARNESSES.load("command")()
    out = command.launch(TASK, command.config_class(command="python3 agent.py --x 'y'"))
    assert "OPENAI_BASE_URL=http://127.0.0.1:9/v1" in out.command and "OPENAI_API_KEY=k3y" in out.command
    assert out.command.endswith("bash -c 'python3 agent.py --x '\"'\"'y'\"'\"''")
    with pytest.raises(ValueError):
        command.config_class(command="x", shell="zsh")
    assert is_harness_agent({"agent": {"harness": "command"}}) and not is_harness_agent({"agent": "x"})
