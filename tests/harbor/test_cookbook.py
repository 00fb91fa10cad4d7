"""The harbor-cookbook's recipes (github.com/harbor-framework/harbor-cookbook), as a new user runs
them: each recipe that needs no GUI, no MCP server and no sidecar earns its full reward with the
oracle and 0 with an agent that does nothing (``skills`` too: its skills folder goes to the agent);
each of the others is refused at submission with a
400 naming the task.toml key or the compose file. The cookbook is not shipped here: clone it and
name its ``harbor_cookbook/recipes`` directory in ``PRORL_HARBOR_COOKBOOK``."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import requests

from tests.harbor.test_harbor_e2e import NOOP, ORACLE, result, run

COOKBOOK = os.environ.get("PRORL_HARBOR_COOKBOOK")
pytestmark = [pytest.mark.harbor,
              pytest.mark.skipif(not COOKBOOK, reason="PRORL_HARBOR_COOKBOOK names no clone of the harbor-cookbook's "
                                                      "harbor_cookbook/recipes (git clone "
                                                      "https://github.com/harbor-framework/harbor-cookbook)")]
RUNNABLE = {  # recipe -> the named rewards the oracle earns
    "simple-task": {"reward": 1.0},
    "multi-reward": {"correctness": 1.0, "performance": 1.0},
    "multi-step": {"reward": 1.0},
    "dns-blacklisting": {"reward": 1.0},
    "skills": {"reward": 1.0},  # its skills_dir goes to the agent (tasks/harbor/tools.py)
}
REFUSED = {  # recipe -> the field its refusal names (their MCP servers are compose sidecars)
    "mcp-tools": "task.toml.environment",
    "simulated-user": "task.toml.environment",
    "multi-container": "task.toml.environment",
    "computer-use-ubuntu": "task.toml.environment",
    "computer-use-windows": "task.toml.environment",
}


@pytest.fixture(scope="module")
def recipes(tmp_path_factory) -> Path:
    """The recipes copied beneath pytest's tmp (a directory the tests' operator allows)."""
    return Path(shutil.copytree(COOKBOOK, tmp_path_factory.mktemp("cookbook") / "recipes"))


@pytest.mark.parametrize("name", sorted(RUNNABLE))
def test_the_oracle_earns_the_full_reward_and_a_noop_agent_nothing(api, recipes, name):
    solved = result(run(api, recipes / name, ORACLE))
    assert solved["harbor"]["rewards"] == RUNNABLE[name], solved["harbor"]["steps"][-1].get("output", "")[-3000:]
    assert solved["reward"] == 1.0
    assert result(run(api, recipes / name, NOOP))["reward"] == 0.0


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_recipe_that_needs_what_is_not_run_here_is_refused_by_name(api, recipes, name):
    resp = requests.post(f"{api}/jobs", json={"instance": {"data_source": "harbor", "task_dir": str(recipes / name)}},
                         timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["field"] == REFUSED[name], resp.text
