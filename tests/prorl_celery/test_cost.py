"""A trajectory's cost from its call records, and the per-project totals ``/metrics`` exports."""
from __future__ import annotations

import uuid

import pytest
import redis

from prorl_celery.models import Timings
from prorl_celery import keys
from prorl_celery.rollout.cost import OPERATOR, add_totals, cost_of, read_heads, totals
from prorl_celery.rollout.store import Call

pytestmark = pytest.mark.unit


def test_every_prompt_counts_whole_and_each_backend_apart(redis_url):
    first = Call.of([1, 2, 3, 4], [5, 6], [-0.1, -0.2], {"backend_id": "b1", "latency_s": 0.5, "cached_tokens": 0})
    # the second prompt extends the first: stored as 4 new ids past the 6 kept, sent as 10
    second = Call.of([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11], [-0.3],
                     {"backend_id": "b2", "latency_s": 0.25, "cached_tokens": 6}, context=[1, 2, 3, 4, 5, 6])
    chat = Call.of(None, None, None, {"backend_id": "b2", "latency_s": 1.0})
    assert second.keep == 6 and len(second.new_ids) == 4
    client = redis.Redis.from_url(redis_url)
    rid = f"cost-{uuid.uuid4().hex[:8]}"
    client.rpush(keys.rollout_calls(rid), *[c.pack() for c in (first, second, chat)], b"a stray write past the save")
    heads = read_heads(client, [(rid, 3), ("no-such-rollout", None), (rid, 0)])
    assert [len(h) for h in heads] == [3, 0, 0] and all(b"_k" in h and len(h) < 200 for h in heads[0])
    client.delete(keys.rollout_calls(rid))
    cost = cost_of(heads[0], Timings(run=3.0, total=4.0, llm=1.75))
    assert cost.llm["b1"].model_dump() == {"calls": 1, "prompt_tokens": 4, "generated_tokens": 2, "cached_tokens": 0,
                                           "llm_s": 0.5, "calls_without_ids": 0}
    assert cost.llm["b2"].model_dump() == {"calls": 2, "prompt_tokens": 10, "generated_tokens": 1, "cached_tokens": 6,
                                           "llm_s": 1.25, "calls_without_ids": 1}
    assert (cost.prompt_tokens, cost.generated_tokens, cost.llm_calls, cost.llm_s) == (14, 3, 3, 1.75)
    assert cost.wall_s["run"] == 3.0 and cost.wall_s["total"] == 4.0 and cost.sandbox is None


def test_project_totals_reach_the_metrics(redis_url):
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from prorl_celery.jobs import JobStore
    from prorl_celery.metrics import ServiceCollector
    from prorl_celery.projects import ProjectStore

    client = redis.Redis.from_url(redis_url)
    name = f"cost-{uuid.uuid4().hex[:8]}"
    ProjectStore(client).add(name)
    head = Call.of([1, 2, 3], [4, 5], None, {"backend_id": "b", "latency_s": 2.0}).pack()[4:]
    one = cost_of([head[:head.index(b"}") + 1]], Timings(total=9.0))
    add_totals(client, [(name, one), (name, one), (None, one)])
    assert totals(client)[name] == {"jobs": 2, "prompt_tokens": 6, "generated_tokens": 4, "llm_calls": 2,
                                    "llm_s": 4.0, "run_s": 0.0, "total_s": 18.0}
    assert totals(client)[OPERATOR]["jobs"] >= 1
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(JobStore(client)))
    text = generate_latest(registry).decode()
    assert f'prorl_project_prompt_tokens_total{{project="{name}"}} 6.0' in text
    assert f'prorl_project_llm_seconds_total{{project="{name}"}} 4.0' in text
    assert f'prorl_project_jobs{{project="{name}",status="queued"}} 0.0' in text
    ProjectStore(client).revoke(name)


def test_the_operators_prices_make_one_number(monkeypatch):
    from config.settings import get_settings
    from prorl_celery.rollout.cost import BackendCost, Cost, price_of

    cost = Cost(llm={"big": BackendCost(calls=2, prompt_tokens=1000, generated_tokens=100, cached_tokens=800, llm_s=4),
                     "small": BackendCost(calls=1, prompt_tokens=500, generated_tokens=50)},
                wall_s={"run": 10.0, "total": 12.0})
    assert price_of(cost, {}) is None
    prices = {"prompt_tokens": 0.001, "generated_tokens": 0.01, "cached_tokens": -0.0005,
              "big.generated_tokens": 0.03, "wall_s.run": 0.1}
    assert price_of(cost, prices) == pytest.approx(1000 * 0.001 + 100 * 0.03 - 800 * 0.0005 + 500 * 0.001
                                                   + 50 * 0.01 + 10 * 0.1)
    monkeypatch.setattr(get_settings(), "cost_prices", {"generated_tokens": 2.0})
    head = Call.of([1, 2], [3, 4, 5], None, {"backend_id": "b"}).pack()[4:]
    assert cost_of([head[:head.index(b"}") + 1]], Timings()).price == 6.0


def test_sandbox_usage_adds_up_and_reaches_totals_price_and_metrics(redis_url, monkeypatch):
    """Each close's reading adds to the job's (CPU summed, peaks summed: sandboxes side by side);
    the project's totals keep the CPU-seconds and the largest peak of one job; a price per
    sandbox CPU-second; an unmeasured job (None) leaves the sandbox totals alone."""
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from config.settings import get_settings
    from prorl_celery.jobs import JobStore
    from prorl_celery.metrics import ServiceCollector
    from prorl_celery.projects import ProjectStore
    from prorl_celery.rollout.cost import add_usage
    from sandboxes.protocol import SandboxUsage, combine_usage

    assert combine_usage([None, None]) is None
    agent = combine_usage([{"cpu_s": 1.5, "peak_memory_mb": 100.0}, {"cpu_s": None, "peak_memory_mb": 20.0}])
    assert (agent.cpu_s, agent.peak_memory_mb, agent.sandboxes) == (1.5, 120.0, 2)
    spent = add_usage(add_usage(None, agent), SandboxUsage(cpu_s=0.25, peak_memory_mb=30.0))
    assert spent == {"cpu_s": 1.75, "peak_memory_mb": 150.0, "source": "cgroup", "sandboxes": 3}
    monkeypatch.setattr(get_settings(), "cost_prices", {"sandbox.cpu_s": 2.0, "wall_s.total": 0.5})
    measured = cost_of([], Timings(total=4.0), spent)
    assert measured.sandbox.cpu_s == 1.75 and measured.price == pytest.approx(1.75 * 2.0 + 4.0 * 0.5)
    small = cost_of([], Timings(total=1.0), {"cpu_s": 0.5, "peak_memory_mb": 40.0})
    unmeasured = cost_of([], Timings(total=1.0))
    assert unmeasured.sandbox is None and unmeasured.price == 0.5
    client = redis.Redis.from_url(redis_url)
    name = f"cost-{uuid.uuid4().hex[:8]}"
    ProjectStore(client).add(name)
    add_totals(client, [(name, measured), (name, small), (name, unmeasured)])
    got = totals(client)[name]
    assert (got["jobs"], got["sandbox_jobs"], got["sandbox_cpu_s"], got["sandbox_peak_memory_mb"]) == (3, 2, 2.25, 150.0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(JobStore(client)))
    text = generate_latest(registry).decode()
    assert f'prorl_project_sandbox_cpu_seconds_total{{project="{name}"}} 2.25' in text
    assert f'prorl_project_sandbox_peak_memory_mb{{project="{name}"}} 150.0' in text
    assert f'prorl_project_sandbox_measured_total{{project="{name}"}} 2.0' in text
    ProjectStore(client).revoke(name)
