"""Hostile math answers cost only their own score, through the whole service.

Twelve jobs answer ``2^{2^{30}}`` and the like (seconds of sympy and hundreds of MB each), two
honest jobs come right behind them, and the eval worker takes all fourteen at once (as a wide
eval pool does); its verifier pool (:mod:`tasks.verify.math_pool`, two checks at a time) must
grade the honest ones 1 whatever the flood does to its own checks. A stack of its own (the eval
concurrency), under ``-m slow`` (~1-2 minutes)."""
from __future__ import annotations

import pytest
import requests

from tests.conftest import own_stack, submit, wait
from tests.tasks.math_flood_policy import MARK

POLICY = ["--policy", "oracle:tests.tasks.math_flood_policy:reply", "--latency-model", "none"]
HOSTILE = ["2^{2^{30}}", "2^{2^{30}}+1", "3^{3^{20}}", "2^{2^{30}}"] * 3
HONEST = [("\\frac{1}{2}", "0.5"), ("7", "7")]


def _job(api: str, answer: str, reference: str) -> str:
    return submit(api, {"data_source": "math", "problem": f"A task. {MARK}{answer}", "answer": reference})


pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def wide_eval(tmp_path_factory):
    """A stack of its own whose eval worker grades every job of the flood at once."""
    jobs = len(HOSTILE) + len(HONEST)
    with own_stack(tmp_path_factory.mktemp("math-flood"), persist=False,
                   concurrency={"init": 8, "run": jobs, "eval": jobs, "maint": 1},
                   env={"PRORL_SANDBOX_CAPACITY": str(jobs + 8)}) as stack:
        url = stack.start_fake_llm(name="fake-math-flood", extra_args=POLICY)
        resp = requests.post(f"{stack.api_url}/llm_servers", json={"address": url, "protocol": "chat"}, timeout=10)
        assert resp.status_code == 201, resp.text
        yield stack


def test_a_flood_of_hostile_answers_leaves_honest_rewards_intact(wide_eval):
    api = wide_eval.api_url
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
