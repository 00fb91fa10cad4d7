"""``/healthz``'s worker census in process: a probe asks only the workers the last full census
found (Celery then returns once they replied, not after its whole timeout); the full census runs
in the probe only the first time, later behind it."""
from __future__ import annotations

import time

import pytest

from flask_api.health import WorkerCensus
from tests.conftest import wait_until

pytestmark = pytest.mark.unit  # in process (tests/unit_tier.py)

FULL = {"init": {"init@a": 2}, "run": {"run@a": 4}, "eval": {}}


def test_probes_ask_the_named_workers_and_the_census_runs_behind():
    calls: list[list[str] | None] = []

    def fetch(workers):
        calls.append(workers)
        return FULL if workers is None else {"init": {"init@a": 2}, "run": {}, "eval": {}}  # run@a is gone

    census = WorkerCensus(fetch, full_every_s=0.2)
    assert census.get() == FULL and calls == [None]  # the first probe takes the census itself
    assert census.get()["run"] == {} and calls == [None, ["init@a", "run@a"]]  # then asks those only
    time.sleep(0.3)
    census.get()  # the census is old: it runs again, behind this probe
    wait_until(lambda: calls.count(None) == 2, 5, "the census behind the probe")


def test_with_no_worker_found_the_last_census_is_the_answer():
    calls: list[list[str] | None] = []
    census = WorkerCensus(lambda workers: calls.append(workers) or {"init": {}}, full_every_s=60)
    assert census.get() == census.get() == {"init": {}} and calls == [None]
