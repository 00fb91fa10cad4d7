"""Prometheus metrics and the status table, read from a running service."""
from __future__ import annotations

import re
import subprocess
import sys

import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import submit, wait


def _samples(api: str) -> dict[tuple[str, tuple], float]:
    text = requests.get(f"{api}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_count_jobs_and_stages(api):
    before = _samples(api)
    key = ("prorl_jobs_finished_total", (("data_source", "shell"), ("status", "completed")))
    runs = ("prorl_stage_seconds_count", (("stage", "run"),))
    ids = [submit(api, {"data_source": "shell", "commands": ["true"], "sandbox": {"runtime": "local"}})
           for _ in range(3)]
    for job_id in ids:
        wait(api, job_id)
    after = _samples(api)
    assert after[key] - before.get(key, 0) == 3
    assert after[runs] - before.get(runs, 0) == 3
    ended = ("prorl_project_finished_total", (("project", "_operator"),))  # the operator's token: _operator
    assert after[ended] - before.get(ended, 0) == 3
    assert ("prorl_queue_depth", (("queue", "run"),)) in after
    hosts = [k for k in after if k[0] == "prorl_sandbox_capacity"]
    assert hosts and all(after[k] > 0 for k in hosts)


def test_status_command_prints_queues_workers_and_jobs(stack):
    out = subprocess.run([sys.executable, "-m", "prorl_celery.ops.cli", "status"], capture_output=True, text=True,
                         timeout=60, env=stack.env(), check=True).stdout
    for queue in ("init", "run", "eval", "maint"):
        assert re.search(rf"^{queue}\s+\d+\s+{queue}@", out, re.M), out
    assert re.search(r"^completed\s+[1-9]\d*$", out, re.M), out
    assert "sandbox host" in out and "llm backend" in out
    assert re.search(r"^_operator\s+[1-9]\d*\s+\d+", out, re.M), out  # the cost totals of the operator's jobs
