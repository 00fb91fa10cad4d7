"""Real mini-swe-agent (the PyPI package, installed for sandboxes by scripts/install-harnesses.sh)
fixes the SWE fixture through the whole service: the API, Celery's init/run/eval, a bwrap sandbox
without network whose one way out is its session's gateway, with the fake LLM playing the oracle
in mini-swe-agent's own format (OpenAI chat tool calls of its ``bash`` tool)."""
from __future__ import annotations

from pathlib import Path

import pytest
import requests

from prorl_celery.fakes import swe
from tasks.harnesses.mini_swe_agent import mini_binary
from tests.conftest import submit, wait

pytestmark = pytest.mark.skipif(not Path(mini_binary()).is_absolute(), reason="mini-swe-agent is not "
                                "installed for sandboxes (bash scripts/install-harnesses.sh)")
# played as vLLM's token API started with --enable-return-routed-experts (a MoE model of 4 layers,
# top-2) and --enable-prompt-tokens-details: each span's trace and cache hit pass through the gateway
ORACLE = ["--policy", "oracle:prorl_celery.fakes.harness_oracle:reply", "--latency-model", "none",
          "--routed-experts", "4x2", "--prompt-tokens-details"]


@pytest.fixture(scope="module")
def oracle_llm(stack, api):
    """One token-mode backend played by the harness oracle; nothing else registered."""
    requests.post(f"{api}/clear_llm_server", timeout=10)
    url = stack.start_fake_llm(name="fake-harness-oracle", extra_args=ORACLE)
    resp = requests.post(f"{api}/llm_servers", json={"address": url, "protocol": "generate", "dialect": "vllm-generate",
                                                      "weight_version": "w1"}, timeout=10)
    assert resp.status_code == 201, resp.text
    yield url
    requests.post(f"{api}/clear_llm_server", timeout=10)


def _served(url: str, since: int) -> list[dict]:
    got = requests.get(f"{url}/debug/requests", params={"since": since}, timeout=5).json()["requests"]
    return [r for r in got if r["status"] == "ok"]


def generated(result: dict) -> list[dict]:
    """The result's assistant messages the gateway generated (the conversation's others are the
    harness's system, task and tool messages, and any it sent again)."""
    return [m for m in result["messages"] if m["role"] == "assistant" and not m.get("resent")]


def test_mini_swe_agent_fixes_the_swe_fixture(api, oracle_llm, tmp_path):
    since = len(requests.get(f"{oracle_llm}/debug/requests", timeout=5).json()["requests"])
    instance = {**swe.build("statkit", tmp_path / "repos"),
                "agent": {"harness": "mini_swe_agent", "max_calls": 12, "wall_s": 120}}
    view = wait(api, submit(api, instance), timeout=240)
    result = view["result"]
    assert view["status"] == "completed", result
    assert result["reward"] == 1.0 and result["resolved"] is True, result.get("eval")
    assert result["finish_reason"] == "submitted", result["harness"]["output"][-2000:]
    served = _served(oracle_llm, since)
    calls = generated(result)
    assert len(calls) == len(served) == result["turns"] >= 3
    assert result["messages"][0]["role"] == "system" and result["messages"][1]["role"] == "user"
    assert [c["token_ids"] for c in calls] == [s["response_ids"] for s in served]
    assert all(c["weight_version"] == "w1" and len(c["logprobs"]) == len(c["token_ids"]) for c in calls)
    # mini-swe-agent keeps its whole history: each prompt extends the last one, one segment
    harness = result["harness"]
    assert result["token_mode"] == "exact" and harness["counts"]["segments"] == 1
    tokens = result["tokens"]
    assert tokens["prompt_ids"] == served[0]["prompt_ids"]
    assert tokens["prompt_ids"] + tokens["response_ids"] == served[-1]["prompt_ids"] + served[-1]["response_ids"]
    assert sum(tokens["loss_mask"]) == sum(len(s["response_ids"]) for s in served)
    assert "+" in result["git_patch"]
    # what the server said of each span: the replica, its routing trace and cache hit, unchanged
    assert [c["routed_experts"] for c in calls] == [s["routed_experts"] for s in served]
    assert [c["cached_tokens"] for c in calls] == [s["cached_tokens"] for s in served]
    (segment,) = harness["segments"]
    assert [(s["call"], s["address"], s["routed_experts"]) for s in segment["served"]] == [
        (k, oracle_llm, s["routed_experts"]) for k, s in enumerate(served)]
    assert max(s["cached_tokens"] for s in served[1:]) > 0  # later prompts extend earlier ones


def test_mini_swe_agent_answers_a_math_task(api, oracle_llm):
    from prorl_celery.fakes.problems import MATH

    task = MATH[0]
    instance = {"data_source": "math", "problem": task["problem"], "answer": task["answer"],
                "agent": {"harness": "mini_swe_agent", "max_calls": 6, "wall_s": 120}}
    view = wait(api, submit(api, instance), timeout=240)
    result = view["result"]
    assert view["status"] == "completed", result
    assert result["reward"] == 1.0 and result["finish_reason"] == "submitted", result["harness"]["output"][-2000:]
    assert result["turns"] == 2 and result["token_mode"] == "exact"
