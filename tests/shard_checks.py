"""What the shard-kill tests check, on one node (tests/chaos/test_shard_kill.py) or across network
namespaces (tests/multinode/test_netns_shards.py): rollouts of :class:`tests.handlers_for_shards.TurnsHandler`
(``turns`` saved turns each) while a store shard is SIGKILLed and started again."""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

import redis

from prorl_celery import keys

HANDLER = "tests.handlers_for_shards:TurnsHandler"
# tasks/stages.py logs it when a stage's store call fails (the stage stops; the sweep resumes it)
_CUT = re.compile(r"job (\S+): \S+ stage lost the job store")


def instance(turns: int, turn_s: float = 0.25) -> dict:
    return {"data_source": HANDLER, "turns": turns, "turn_s": turn_s}


def said(turns: int) -> list[str]:
    """The assistant's messages of a complete rollout, in order."""
    return [f"Step {k}: look at the tools available." for k in range(turns)]


def mid_turns(store: redis.Redis, job_ids: Iterable[str], turns: int) -> int:
    """How many of ``job_ids`` have some turns saved on ``store`` but not all: a kill now cuts them."""
    saved = [store.llen(keys.rollout_calls(j)) for j in job_ids]
    return sum(0 < n < turns for n in saved)


def check_views(views: dict[str, dict], turns: int) -> Counter:
    """Every view ended completed or with a typed failure; every completed one holds its turns
    exactly once, in order. The statuses, counted."""
    statuses = Counter()
    for job_id, view in views.items():
        statuses[view["status"]] += 1
        result = view["result"]
        assert view["status"] in {"completed", "failed"}, view
        assert result["job_id"] == job_id
        if view["status"] == "failed":
            assert result["error"]["type"], result  # a typed failure, never a silent one
            continue
        assert result["reward"] == 1.0 and result["turns"] == turns, (job_id, result.get("turns"))
        assert [m["content"] for m in result["messages"] if m["role"] == "assistant"] == said(turns), job_id
    return statuses


def check_completions(entries: list, job_ids: Iterable[str]) -> Counter:
    """The completion stream's entries (``XRANGE``): one per job, none lost, none twice."""
    counts = Counter(fields[b"job_id"].decode() for _, fields in entries)
    assert set(counts) == set(job_ids), set(job_ids) ^ set(counts)
    assert max(counts.values()) == 1, {j: n for j, n in counts.items() if n > 1}
    return counts


def cut_stages(log_text: str) -> list[str]:
    """The jobs whose stage the store's loss cut, one entry per cut, from the run workers' logs."""
    return _CUT.findall(log_text)
