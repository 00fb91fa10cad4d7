"""Hostile math answers cost only their own score, through the whole service.

Twelve jobs answer ``2^{2^{30}}`` (seconds of sympy and hundreds of MB each), two honest jobs
come right behind them; the eval worker's verifier pool (:mod:`tasks.verify.math_pool`) must
grade the honest ones 1 whatever the flood does to its own checks."""
from __future__ import annotations

import requests

from tests.conftest import submit, wait
from tests.tasks.math_flood_policy import MARK

POLICY = ["--policy", "oracle:tests.tasks.math_flood_policy:reply", "--latency-model", "none"]
HOSTILE = ["2^{2^{30}}", "2^{2^{30}}+1", "3^{3^{20}}", "2^{2^{30}}"] * 3
HONEST = [("\\frac{1}{2}", "0.5"), ("7", "7")]


def _job(api: str, answer: str, reference: str) -> str:
    return submit(api, {"data_source": "math", "problem": f"A task. {MARK}{answer}", "answer": reference})


def test_a_flood_of_hostile_answers_leaves_honest_rewards_intact(stack, api):
    requests.post(f"{api}/clear_llm_server", timeout=10)
    url = stack.start_fake_llm(name="fake-math-flood", extra_args=POLICY)
    assert requests.post(f"{api}/llm_servers", json={"address": url, "protocol": "chat"}, timeout=10).status_code == 201
    try:
        hostile = [_job(api, answer, "1") for answer in HOSTILE]
        honest = [_job(api, answer, reference) for answer, reference in HONEST]
        for job_id in honest:
            view = wait(api, job_id, timeout=240)
            result = view["result"]
            assert view["status"] == "completed", result
            assert result["reward"] == 1.0 and result["resolved"] is True, result["eval"]
            assert result["eval"]["check"] == "equal", result["eval"]
        for job_id in hostile:
            view = wait(api, job_id, timeout=240)
            assert view["status"] == "completed" and view["result"]["reward"] == 0.0, view["result"]
            assert view["result"]["eval"]["check"] in ("different", "exceeded"), view["result"]["eval"]
    finally:
        requests.post(f"{api}/clear_llm_server", timeout=10)
