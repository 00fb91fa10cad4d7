"""Real Claude Code (its npm package's native binary) fixes the SWE fixture through the whole
service, in a bwrap sandbox whose one way out is its session's gateway, with the fake LLM playing
the oracle in Claude Code's own API (Anthropic Messages, streamed, ``Bash`` tool uses).
``-m harness``: ``bash scripts/install-harnesses.sh claude-code`` first (a ~360 MB download)."""
from __future__ import annotations

from pathlib import Path

import pytest
import requests

from prorl_celery.fakes import swe
from tasks.harnesses.claude_code import claude_binary
from tests.conftest import submit, wait
from tests.harnesses.test_mini_swe_agent import _served, generated

pytestmark = [pytest.mark.harness,
              pytest.mark.skipif(not Path(claude_binary()).is_absolute(), reason="Claude Code is not installed "
                                 "(bash scripts/install-harnesses.sh claude-code)")]
# Claude Code's system prompt and ~25 tools are ~100k bytes: the byte tokenizer needs the room
ORACLE = ["--policy", "oracle:prorl_celery.fakes.harness_oracle:reply", "--latency-model", "none",
          "--max-model-len", "1000000"]


@pytest.fixture(scope="module")
def big_oracle_llm(stack, api):
    requests.post(f"{api}/clear_llm_server", timeout=10)
    url = stack.start_fake_llm(name="fake-harness-oracle-1m", extra_args=ORACLE)
    resp = requests.post(f"{api}/llm_servers", json={"address": url, "protocol": "generate", "dialect": "fake",
                                                      "weight_version": "w2"}, timeout=10)
    assert resp.status_code == 201, resp.text
    yield url
    requests.post(f"{api}/clear_llm_server", timeout=10)


def test_claude_code_fixes_the_swe_fixture(api, big_oracle_llm, tmp_path):
    since = len(requests.get(f"{big_oracle_llm}/debug/requests", timeout=5).json()["requests"])
    instance = {**swe.build("statkit", tmp_path / "repos"), "sandbox": {"limits": {"memory_mb": 4096}},
                "agent": {"harness": "claude_code", "max_calls": 20, "wall_s": 300}}
    view = wait(api, submit(api, instance), timeout=420)
    result = view["result"]
    assert view["status"] == "completed", result
    assert result["reward"] == 1.0 and result["resolved"] is True, result["harness"]["output"][-3000:]
    assert result["finish_reason"] == "submitted", result["harness"]["output"][-3000:]
    served = _served(big_oracle_llm, since)
    calls = generated(result)
    assert len(calls) == len(served) >= 3
    assert [c["token_ids"] for c in calls] == [s["response_ids"] for s in served]
    # the main loop keeps its history: its calls chain into one segment (side calls, if any, are
    # segments of their own)
    longest = max(result["harness"]["segments"], key=lambda s: len(s["calls"]))
    assert len(longest["calls"]) >= 3 and sum(longest["loss_mask"]) > 0


def test_claude_code_answers_a_math_task(api, big_oracle_llm):
    from prorl_celery.fakes.problems import MATH

    task = MATH[0]
    instance = {"data_source": "math", "problem": task["problem"], "answer": task["answer"],
                "sandbox": {"limits": {"memory_mb": 4096}},
                "agent": {"harness": "claude_code", "max_calls": 10, "wall_s": 300}}
    view = wait(api, submit(api, instance), timeout=420)
    result = view["result"]
    assert view["status"] == "completed", result
    assert result["reward"] == 1.0 and result["finish_reason"] == "submitted", result["harness"]["output"][-3000:]
