"""The fake server itself: its latency model behaves like a batching GPU server, and it says so."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import requests

from prorl_celery.llm.fake_engine import LatencyModel


def _generate(url: str, tokens: int) -> float:
    started = time.monotonic()
    resp = requests.post(f"{url}/generate", json={"prompt_ids": [1, 2, 3], "max_tokens": tokens,
                                                  "ignore_eos": True}, timeout=30)
    assert resp.status_code == 200 and len(resp.json()["response_ids"]) == tokens
    return time.monotonic() - started


def test_time_per_token_grows_with_concurrency_up_to_capacity(fake_llms):
    (proc,) = fake_llms(1, latency="step_s=0.01,capacity=4,slowdown=1")
    alone = _generate(proc.url, 20)  # 20 steps of 10 ms
    with ThreadPoolExecutor(4) as ex:
        four = list(ex.map(lambda _: _generate(proc.url, 20), range(4)))  # 20 steps of 17.5 ms
    started = time.monotonic()
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda _: _generate(proc.url, 20), range(8)))  # two batches of four
    eight = time.monotonic() - started
    assert 0.18 < alone < 0.35
    assert 0.33 < min(four) and max(four) < 0.6
    assert 0.68 < eight < 1.1
    stats = proc.stats()
    assert stats["peak_running"] == 4 and stats["completed"] == 13 and stats["aborted"] == 0
    assert 0 < stats["occupancy"] <= stats["busy_fraction"] <= 1


def test_speed_factor_and_model_parsing():
    model = LatencyModel.parse("batch:step_s=0.02,capacity=8", speed=0.25)
    assert model.capacity == 8 and model.step_time(1) == 0.08
    assert model.step_time(8) > model.step_time(1)
    assert LatencyModel.parse("none").step_s == 0


def test_health_models_faults_and_banner(fake_llms):
    (proc,) = fake_llms(1)
    assert "test and demo tool" in requests.get(f"{proc.url}/health", timeout=5).json()["note"]
    assert requests.get(f"{proc.url}/v1/models", timeout=5).json()["data"][0]["id"] == "prorl-fake-byte"
    proc.faults(fail_next=1, healthy=False)
    assert requests.get(f"{proc.url}/health", timeout=5).status_code == 503
    body = {"messages": [{"role": "user", "content": "x"}]}
    assert requests.post(f"{proc.url}/v1/chat/completions", json=body, timeout=5).status_code == 500
    assert requests.post(f"{proc.url}/v1/chat/completions", json=body, timeout=5).status_code == 200
    bad = requests.post(f"{proc.url}/generate", json={"prompt_ids": "nope"}, timeout=5)
    assert bad.status_code == 400 and "prompt_ids" in bad.json()["error"]["message"]
