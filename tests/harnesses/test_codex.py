"""Real Codex (its npm package's native binary) fixes the SWE fixture and answers a math task
through the whole service, in a bwrap sandbox whose one way out is its session's gateway, the fake
LLM playing the oracle in Codex's own API (OpenAI Responses, streamed, ``exec_command`` calls).
``-m harness``: ``bash scripts/install-harnesses.sh codex`` first (a ~400 MB download)."""
from __future__ import annotations

from pathlib import Path

import pytest
import requests

from prorl_celery.fakes import swe
from prorl_celery.fakes.problems import MATH
from tasks.harnesses.codex import codex_binary
from tests.conftest import submit, wait
from tests.harnesses.test_claude_code import big_oracle_llm  # noqa: F401 - fixture
from tests.harnesses.test_mini_swe_agent import _served, generated

pytestmark = [pytest.mark.harness,
              pytest.mark.skipif(not Path(codex_binary()).is_absolute(), reason="Codex is not installed "
                                 "(bash scripts/install-harnesses.sh codex)")]


def _run(api, instance: dict) -> dict:
    view = wait(api, submit(api, {**instance, "sandbox": {"limits": {"memory_mb": 4096}}}), timeout=420)
    assert view["status"] == "completed", view["result"]
    return view["result"]


def test_codex_fixes_the_swe_fixture(api, big_oracle_llm, tmp_path):
    since = len(requests.get(f"{big_oracle_llm}/debug/requests", timeout=5).json()["requests"])
    result = _run(api, {**swe.build("statkit", tmp_path / "repos"),
                        "agent": {"harness": "codex", "max_calls": 20, "wall_s": 300}})
    assert result["reward"] == 1.0 and result["finish_reason"] == "submitted", result["harness"]["output"][-3000:]
    served = _served(big_oracle_llm, since)
    assert [c["token_ids"] for c in generated(result)] == [s["response_ids"] for s in served]
    longest = max(result["harness"]["segments"], key=lambda s: len(s["calls"]))
    assert len(longest["calls"]) >= 3


def test_codex_answers_a_math_task(api, big_oracle_llm):
    task = MATH[0]
    result = _run(api, {"data_source": "math", "problem": task["problem"], "answer": task["answer"],
                        "agent": {"harness": "codex", "max_calls": 10, "wall_s": 300}})
    assert result["reward"] == 1.0, result["harness"]["output"][-3000:]
