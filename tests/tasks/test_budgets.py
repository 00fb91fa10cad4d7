"""Each stage has its own budget; an overrun ends the job `timeout` with the stage and the partial
result, and queue time is not charged."""
from __future__ import annotations

import re
import time

import pytest
import requests

from tests.conftest import submit, wait, wait_until

LOCAL = {"runtime": "local"}


def _timed_out(view: dict, stage: str) -> dict:
    result = view["result"]
    assert view["status"] == "timeout", view
    assert result["critical_error"] == "timeout" and result["stage"] == stage
    assert result["error"]["type"] == "timeout"
    return result


def test_run_budget(api):
    job_id = submit(api, {"data_source": "shell", "sandbox": LOCAL, "commands": ["echo one", "sleep 30", "echo no"]},
                    sampling_params={"run_budget_s": 1.5})
    start = time.monotonic()
    result = _timed_out(wait(api, job_id, timeout=30), "run")
    assert time.monotonic() - start < 15
    assert [s["command"] for s in result["steps"]] == ["echo one", "sleep 30"]
    assert result["steps"][0]["output"] == "one\n" and result["steps"][1]["timed_out"]
    assert result["timing"]["run"] < 5


@pytest.mark.parametrize("stage,handler", [("init", "SlowInitHandler"), ("eval", "SlowEvalHandler")])
def test_init_and_eval_budgets(api, stage, handler):
    job_id = submit(api, {"data_source": f"tests.handlers_for_tests:{handler}", "sandbox": LOCAL,
                          "commands": ["true"]}, sampling_params={f"{stage}_budget_s": 1})
    result = _timed_out(wait(api, job_id, timeout=30), stage)
    assert 0.9 < result["timing"][stage] < 5


def test_a_long_run_does_not_starve_eval(api):
    """The run stage used almost all of its budget; eval still gets its own."""
    job_id = submit(api, {"data_source": "tests.handlers_for_tests:SlowEvalHandler", "sandbox": LOCAL,
                          "commands": ["sleep 1.5"]}, sampling_params={"run_budget_s": 2, "eval_budget_s": 1})
    result = _timed_out(wait(api, job_id, timeout=30), "eval")
    assert result["timing"]["run"] > 1.4 and result["timing"]["eval"] > 0.9


def _sweep_timeouts(api: str) -> float:
    text = requests.get(f"{api}/metrics", timeout=10).text
    found = re.search(r'^prorl_sweep_actions_total\{action="timed_out"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_stuck_stage_is_ended_by_the_sweep(api):
    before = _sweep_timeouts(api)
    job_id = submit(api, {"data_source": "tests.handlers_for_tests:StuckRunHandler", "sandbox": LOCAL},
                    sampling_params={"run_budget_s": 1})
    start = time.monotonic()
    result = _timed_out(wait(api, job_id, timeout=30), "run")
    assert time.monotonic() - start < 15  # the handler sleeps 20 s; the sweep ended it first
    assert "sweep" in result["error"]["message"]
    wait_until(lambda: _sweep_timeouts(api) == before + 1, 10, "the sweep to count its action")


@pytest.mark.parametrize("value", [0, -1, "soon", True])
def test_bad_budget_is_400(api, value):
    resp = requests.post(f"{api}/jobs", json={"instance": {"data_source": "shell"},
                                              "sampling_params": {"run_budget_s": value}}, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["field"] == "sampling_params.run_budget_s"
