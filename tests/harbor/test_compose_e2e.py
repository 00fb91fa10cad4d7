"""A Harbor task with sidecar services (``environment/docker-compose.yaml``) end to end on the
real stack: the example ``ledger`` task's services built from their own Dockerfiles
(``python:3.12-slim`` on a Debian trixie root), each in its own sandbox beside the agent's,
reached by name through a forward into the agent's namespace (and from each other: the ``seed``
job writes to the ledger before ``main`` starts), ``depends_on`` honoured; a sidecar that never
gets healthy fails the job as an infrastructure fault naming it, not a reward of 0."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.harbor.test_harbor_e2e import EXAMPLES, NOOP, ORACLE, result, run

pytestmark = pytest.mark.harbor


def test_the_oracle_reaches_the_sidecar_by_name_and_a_noop_agent_earns_nothing(api):
    solved = result(run(api, "ledger", ORACLE))
    harbor = solved["harbor"]
    assert solved["reward"] == 1.0, harbor["steps"][0].get("output", "")[-2000:]
    ledger, seed = harbor["services"]["ledger"], harbor["services"]["seed"]
    assert ledger["ports"] == [8080] and ledger["command"] == ["python", "server.py"]
    assert "debian:trixie" in ledger["image"]["base"] and "python:3.12-slim" in ledger["image"]["base"]
    assert ledger["waited_for_by"] == ["seed", "main"] and ledger["ready_s"] > 0
    assert seed["completed_s"] > 0 and seed["waited_for_by"] == ["main"]
    assert seed["image"]["key"] == ledger["image"]["key"]  # one build context, built once
    assert harbor["network"]["agent"] is False  # the agent stays offline; it reached the ledger by a forward
    assert result(run(api, "ledger", NOOP))["reward"] == 0.0


def test_a_sidecar_that_never_gets_healthy_is_a_fault_naming_it(api, tmp_path):
    task = Path(shutil.copytree(EXAMPLES / "ledger", tmp_path / "sick-ledger"))
    compose = task / "environment" / "docker-compose.yaml"
    text = compose.read_text().replace("('localhost', 8080)", "('localhost', 8099)").replace("retries: 20", "retries: 2")
    compose.write_text(text)
    job = run(api, task, ORACLE)
    assert job["status"] == "failed", job["result"]
    error = job["result"]["error"]
    assert error["type"] == "sidecar_failed" and "service ledger" in error["message"], error
    assert job["result"]["critical_error"] == "init"
