"""Every kind of agent on a Harbor task in an image-rooted (writable) sandbox, and each harness
on a SWE fixture in a built environment (a read-only image root): the harness root and the
gateway's socket directory reach both, and each generated call's ids are the served ones.
The fake LLM plays the oracle in each harness's own format. ``-m harbor`` (the harnesses that
are large downloads are ``harness`` too; each skips when it is not installed)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from prorl_celery.fakes import swe
from tasks.harnesses.claude_code import claude_binary
from tasks.harnesses.codex import codex_binary
from tasks.harnesses.mini_swe_agent import mini_binary
from tests.conftest import ROOT, submit, wait
from tests.harbor.test_harbor_e2e import run
from tests.harnesses.test_mini_swe_agent import _served, generated, oracle_llm  # noqa: F401 - a fixture

pytestmark = pytest.mark.harbor


def _installed(binary: str, what: str):
    return pytest.mark.skipif(not Path(binary).is_absolute(), reason=f"{what} is not installed "
                              "(bash scripts/install-harnesses.sh ...)")


HARNESSES = [
    pytest.param({"harness": "mini_swe_agent", "max_calls": 12, "wall_s": 180}, id="mini_swe_agent",
                 marks=_installed(mini_binary(), "mini-swe-agent")),
    pytest.param({"harness": "claude_code", "max_calls": 20, "wall_s": 300}, id="claude_code",
                 marks=[pytest.mark.harness, _installed(claude_binary(), "Claude Code")]),
    pytest.param({"harness": "codex", "max_calls": 20, "wall_s": 300}, id="codex",
                 marks=[pytest.mark.harness, _installed(codex_binary(), "Codex")]),
]


def _exact(result: dict, url: str, since: int) -> None:
    calls, served = generated(result), _served(url, since)
    assert len(calls) == len(served) >= 1
    assert [c["token_ids"] for c in calls] == [s["response_ids"] for s in served]


def _since(url: str) -> int:
    return len(requests.get(f"{url}/debug/requests", timeout=5).json()["requests"])


@pytest.mark.parametrize("agent", HARNESSES)
def test_a_harness_solves_a_harbor_task_in_an_image_rooted_sandbox(api, oracle_llm, agent):
    since = _since(oracle_llm)
    job = run(api, "hello", {**agent})
    result = job["result"]
    assert job["status"] == "completed", result
    assert result["reward"] == 1.0, result.get("harness", {}).get("output", "")[-3000:]
    assert result["harness"]["route"] in ("direct", "relay")
    _exact(result, oracle_llm, since)


def test_the_builtin_agent_solves_single_and_multi_step_harbor_tasks(api, oracle_llm):
    for task in ("hello", "stages"):
        since = _since(oracle_llm)
        job = run(api, task, None)
        result = job["result"]
        assert job["status"] == "completed", result
        assert result["reward"] == 1.0, json.dumps(result.get("harbor"))[-3000:]
        assert result["token_mode"] == "exact" and len(result["messages"]) >= 3
        assert _since(oracle_llm) > since


def test_a_harness_runs_every_step_of_a_multi_step_task(api, oracle_llm):
    script = ("if grep -q items \"$PRORL_TASK_FILE\"; then printf '#!/bin/sh\\nwc -l < /srv/tool/items.txt\\n'; "
              "else printf '#!/bin/sh\\necho 0\\n'; fi > /srv/tool/count.sh && chmod +x /srv/tool/count.sh")
    job = run(api, "stages", {"harness": "command", "command": script})
    result = job["result"]
    assert job["status"] == "completed", result
    assert [s["reward"] for s in result["harbor"]["steps"]] == [1.0, 1.0] and result["reward"] == 1.0


@pytest.fixture(scope="module")
def built_env():
    """A built environment (a read-only image root of the node's own packages) for the SWE fixture."""
    from sandboxes.runtimes.env.build import EnvRecipe, ensure_env

    return str(ensure_env(EnvRecipe(name="harbor-harness-swe-fixture")))


@pytest.mark.parametrize("agent", HARNESSES)
def test_a_harness_fixes_a_swe_fixture_in_a_built_environment(api, oracle_llm, built_env, agent, tmp_path,
                                                               monkeypatch):
    since = _since(oracle_llm)
    instance = {**swe.build("statkit", tmp_path / "repos"), "sandbox": {"image": built_env,
                                                                       "limits": {"memory_mb": 4096}},
                "agent": {**agent}}
    view = wait(api, submit(api, instance), timeout=420)
    result = view["result"]
    assert view["status"] == "completed", result
    assert result["reward"] == 1.0, result["harness"]["output"][-3000:]
    assert result["sandbox"]["image"] == built_env
    _exact(result, oracle_llm, since)
