"""A store shard SIGKILLed mid-batch (``pytest -m chaos tests/chaos/test_shard_kill.py``): a stack
with two shards of its own (prorl_celery/shards.py) and two API processes on one port runs
rollouts of many saved turns; one shard is killed while they run, left down a few seconds, and
started again on its data. Every job ends completed or with a typed failed result, none twice in
the completion stream, and each completed rollout holds its turns exactly once, in order (the
stage resumed from what its shard kept).

Size by environment: ``PRORL_SHARD_KILL_JOBS`` (40), ``PRORL_SHARD_KILL_TURNS`` (12)."""
from __future__ import annotations

import os
from collections import Counter

import pytest
import redis
import requests

from prorl_celery import keys
from prorl_celery.shards import Shards
from tests.conftest import own_stack, wait_until

JOBS = int(os.environ.get("PRORL_SHARD_KILL_JOBS", "40"))
TURNS = int(os.environ.get("PRORL_SHARD_KILL_TURNS", "12"))
pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]


def test_a_shard_killed_mid_batch_loses_and_duplicates_nothing(tmp_path_factory):
    with own_stack(tmp_path_factory.mktemp("shards"), persist=True, store_shards=2, api_processes=2,
                   concurrency={"init": 4, "run": 8, "eval": 4, "maint": 1}) as stack:
        api, head = stack.api_url, redis.Redis.from_url(stack.redis_url)
        shards = Shards(head, [redis.Redis.from_url(u) for u in stack.shard_urls])
        instance = {"data_source": "tests.handlers_for_shards:TurnsHandler", "turns": TURNS, "turn_s": 0.25}
        ids = requests.post(f"{api}/jobs", json={"jobs": [{"instance": instance}] * JOBS}, timeout=60).json()["job_ids"]
        on_first = [j for j in ids if shards.index(j) == 0]
        assert on_first and len(on_first) < JOBS  # both shards serve the batch

        def mid_turn_on_first() -> bool:  # some rollouts of shard 1 have turns saved, none finished
            saved = [shards.stores[0].llen(keys.rollout_calls(j)) for j in on_first]
            return sum(0 < n < TURNS for n in saved) >= 2
        wait_until(mid_turn_on_first, 120, "rollouts mid-batch on shard 1")
        stack.restart_redis(name="redis-shard-1", down_s=3.0)  # SIGKILL, 3 s down, back on its data

        statuses, views = Counter(), {}
        for job_id in ids:
            resp = requests.get(f"{api}/jobs/{job_id}/wait", params={"timeout": 300}, timeout=330)
            assert resp.status_code == 200, (job_id, resp.status_code, resp.text[:300])
            views[job_id] = view = resp.json()
            statuses[view["status"]] += 1
            assert view["status"] in {"completed", "failed"}, view
            assert view["result"]["job_id"] == job_id
        for job_id, view in views.items():
            result = view["result"]
            if view["status"] == "failed":
                assert result["error"]["type"], result  # a typed failure, never a silent one
                continue
            assert result["reward"] == 1.0 and result["turns"] == TURNS, (job_id, result.get("turns"))
            said = [m["content"] for m in result["messages"] if m["role"] == "assistant"]
            assert said == [f"Step {k}: look at the tools available." for k in range(TURNS)], job_id
        completions = Counter(fields[b"job_id"].decode() for _, fields in head.xrange(keys.completions()))
        assert set(completions) == set(ids) and max(completions.values()) == 1  # none lost, none twice
        assert statuses["completed"] >= JOBS * 0.9, statuses
        logs = "".join(p.read_text() for p in stack.log_dir.glob("worker-run*.log"))
        cut = logs.count("lost the job store")
        assert cut >= 1, "no stage was cut by the kill: it did not land mid-batch"
        assert stack.children["api"].alive() and stack.children["api-2"].alive()
        assert requests.get(f"{api}/healthz", timeout=10).json()["store_shards"] == ["ok", "ok"]
        resent = logs.count("sending them again")  # a live writer's save after the shard lost its last second
        print(f"shard kill: {dict(statuses)}; shard 1 held {len(on_first)} of {JOBS}; stages cut {cut}; "
              f"saves that sent lost writes again {resent}")
