"""The harbor-cookbook's recipes (github.com/harbor-framework/harbor-cookbook), as a new user runs
them: each recipe that needs no screen earns its full reward with the oracle and 0 with an agent that
does nothing, the sidecar services of a docker-compose.yaml included (multi-container's API
server, mcp-tools' MCP server, simulated-user's); each of the others is refused at submission
with a 400 naming the task.toml key or the compose file. mcp-tools' own solve.sh installs uv and
the ``mcp`` package in the agent's sandbox (it needs ``PRORL_HARBOR_ALLOW_INTERNET=1``) and imports
``streamablehttp_client``, which today's ``mcp`` (2.x) no longer has: it fails wherever it runs. Its
MCP server is checked with a hand-written client instead (plain HTTP from the image's python3,
offline), which earns the recipe's full reward through the sidecar. The cookbook is not shipped here: clone it and
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
    "multi-container": {"reward": 1.0},  # its api-server: a sidecar (tasks/harbor/sidecars.py)
    "simulated-user": {"reward": 1.0},  # its user-server starts with ANTHROPIC_API_KEY interpolated empty
    "computer-use-ubuntu": {"reward": 1.0},  # its desktop: Xvfb and an MCP server in a sidecar, no screen
    "computer-use-windows": {"reward": 1.0},  # its desktop server starts without Daytona's remote Windows
}
REFUSED = {  # recipe -> the field its refusal names
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


# an MCP client in plain Python (streamable HTTP: initialize, then tools/call), as an offline agent
# can write one: mcp-tools' MCP server answers it through the forward into the agent's namespace
MCP_CLIENT = r"""
import json, urllib.request
URL, session = "http://mcp-server:8000/mcp", None
def call(method, params, ident=None):
    global session
    body = {"jsonrpc": "2.0", "method": method, "params": params, **({"id": ident} if ident else {})}
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
               **({"mcp-session-id": session} if session else {})}
    with urllib.request.urlopen(urllib.request.Request(URL, json.dumps(body).encode(), headers), timeout=30) as r:
        session = r.headers.get("mcp-session-id") or session
        text = r.read().decode()
    lines = [l[5:] for l in text.splitlines() if l.startswith("data:")] or [text]
    return json.loads(lines[-1]) if ident else None
call("initialize", {"protocolVersion": "2025-03-26", "capabilities": {}, "clientInfo": {"name": "by-hand", "version": "1"}}, 1)
call("notifications/initialized", {})
for tool, path in (("get_secret", "/app/secret.txt"), ("get_timestamp", "/app/timestamp.txt")):
    open(path, "w").write(call("tools/call", {"name": tool, "arguments": {}}, 2)["result"]["content"][0]["text"])
"""


def test_the_mcp_recipe_s_server_answers_an_offline_agent_by_name(api, recipes):
    from tests.harbor.test_harbor_e2e import command

    solved = result(run(api, recipes / "mcp-tools", command(f"python3 - <<'EOF'\n{MCP_CLIENT}\nEOF")))
    assert solved["reward"] == 1.0, solved["harbor"]["steps"][-1].get("output", "")[-3000:]
    server = solved["harbor"]["services"]["mcp-server"]
    assert "toolkit" not in server["image"]["base"] and any("astral-sh/uv" in n for n in server["image"]["notes"])
    assert result(run(api, recipes / "mcp-tools", NOOP))["reward"] == 0.0


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_recipe_that_needs_what_is_not_run_here_is_refused_by_name(api, recipes, name):
    resp = requests.post(f"{api}/jobs", json={"instance": {"data_source": "harbor", "task_dir": str(recipes / name)}},
                         timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["field"] == REFUSED[name], resp.text
