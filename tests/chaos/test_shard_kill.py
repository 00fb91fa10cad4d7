"""A store shard SIGKILLed mid-batch (``pytest -m chaos tests/chaos/test_shard_kill.py``): a stack
with two shards of its own (prorl_celery/shards.py) and two API processes on one port runs
rollouts of many saved turns; one shard is killed while they run, left down a few seconds, and
started again on its data. Every job ends completed or with a typed failed result, none twice in
the completion stream, and each completed rollout holds its turns exactly once, in order (the
stage resumed from what its shard kept).

Size by environment: ``PRORL_SHARD_KILL_JOBS`` (40), ``PRORL_SHARD_KILL_TURNS`` (12)."""
from __future__ import annotations

import os

import pytest
import redis
import requests

from prorl_celery import keys
from prorl_celery.shards import Shards
from tests.conftest import own_stack, wait_until
from tests.shard_checks import check_completions, check_views, cut_stages, instance, mid_turns

JOBS = int(os.environ.get("PRORL_SHARD_KILL_JOBS", "40"))
TURNS = int(os.environ.get("PRORL_SHARD_KILL_TURNS", "12"))
pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]


def test_a_shard_killed_mid_batch_loses_and_duplicates_nothing(tmp_path_factory):
    with own_stack(tmp_path_factory.mktemp("shards"), persist=True, store_shards=2, api_processes=2,
                   concurrency={"init": 4, "run": 8, "eval": 4, "maint": 1}) as stack:
        api, head = stack.api_url, redis.Redis.from_url(stack.redis_url)
        shards = Shards(head, [redis.Redis.from_url(u) for u in stack.shard_urls])
        jobs = [{"instance": instance(TURNS)}] * JOBS
        ids = requests.post(f"{api}/jobs", json={"jobs": jobs}, timeout=60).json()["job_ids"]
        on_first = [j for j in ids if shards.index(j) == 0]
        assert on_first and len(on_first) < JOBS  # both shards serve the batch

        wait_until(lambda: mid_turns(shards.stores[0], on_first, TURNS) >= 2, 120, "rollouts mid-batch on shard 1")
        stack.restart_redis(name="redis-shard-1", down_s=3.0)  # SIGKILL, 3 s down, back on its data

        views = {}
        for job_id in ids:
            resp = requests.get(f"{api}/jobs/{job_id}/wait", params={"timeout": 300}, timeout=330)
            assert resp.status_code == 200, (job_id, resp.status_code, resp.text[:300])
            views[job_id] = resp.json()
        statuses = check_views(views, TURNS)
        check_completions(head.xrange(keys.completions()), ids)  # none lost, none twice
        assert statuses["completed"] >= JOBS * 0.9, statuses
        logs = "".join(p.read_text() for p in stack.log_dir.glob("worker-run*.log"))
        cut = len(cut_stages(logs))
        assert cut >= 1, "no stage was cut by the kill: it did not land mid-batch"
        assert stack.children["api"].alive() and stack.children["api-2"].alive()
        assert requests.get(f"{api}/healthz", timeout=10).json()["store_shards"] == ["ok", "ok"]
        resent = logs.count("sending them again")  # a live writer's save after the shard lost its last second
        print(f"shard kill: {dict(statuses)}; shard 1 held {len(on_first)} of {JOBS}; stages cut {cut}; "
              f"saves that sent lost writes again {resent}")
