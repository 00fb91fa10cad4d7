"""The sandbox half of the beat sweep against real hosts, a real Redis and the real job store."""
from __future__ import annotations

import signal
import time

import pytest

from config.settings import get_settings
from prorl_celery import keys
from prorl_celery.jobs import JobStore
from prorl_celery.models import JobRequest
from prorl_celery.status import STAGES, JobStatus
from sandboxes.client import list_sandboxes, list_strays, stop_strays
from sandboxes.protocol import Stray
from tasks.outcome import finish
from tasks.sweep.sandboxes import sweep_sandboxes
from tests.sandboxes.test_host import create


@pytest.fixture
def store(redis_client) -> JobStore:
    return JobStore(redis_client)


def running_job(store: JobStore, job_id: str, sandbox=None, stage=JobStatus.RUN) -> None:
    store.create_many([(job_id, JobRequest(instance={"data_source": "shell"}))])
    handle = sandbox.handle.model_dump() if sandbox is not None else None
    for earlier in STAGES[:STAGES.index(stage)]:  # the store allows only the table's moves
        store.transition(job_id, earlier)
    store.transition(job_id, stage, sandbox=handle, stage_state="running", t_stage_start=time.time())


def live_ids(host) -> set[str]:
    return {entry.job_id for entry in list_sandboxes(host.address, host.token)}


def test_sandboxes_whose_job_ended_vanished_or_moved_on_are_closed(start_host, store):
    host = start_host(runtime="local")
    kept = create(host, "job-active")
    running_job(store, "job-active", kept)
    ended = create(host, "job-ended")
    running_job(store, "job-ended", ended)
    finish(store, store.get("job-ended"), JobStatus.CANCELLED, critical_error="cancelled")
    unknown = create(host, "job-unknown")
    create(host, "job-moved")
    running_job(store, "job-moved", kept)  # its record points at another sandbox
    report = sweep_sandboxes(store)
    assert sorted(report["sandboxes_closed"]) == sorted(
        f"{host.host_id}/{box.handle.sandbox_id}" for box in (ended, unknown))
    assert live_ids(host) == {"job-active", "job-moved"}  # young: its init may not have recorded it
    later = time.time() + get_settings().stage_lease_s + 1
    assert len(sweep_sandboxes(store, now=later)["sandboxes_closed"]) == 1
    assert live_ids(host) == {"job-active"}
    assert kept.exec("echo untouched").output == "untouched\n"
    assert sweep_sandboxes(store, now=later)["sandboxes_closed"] == []


def test_a_second_sandbox_a_job_holds_beside_its_own_is_kept(start_host, store):
    host = start_host(runtime="local")
    own, grader, other = create(host, "job-two"), create(host, "job-two"), create(host, "job-two")
    running_job(store, "job-two", own)
    handle = {**own.handle.model_dump(), "aux": [grader.handle.sandbox_id]}  # as StageContext.open_aux_sandbox
    store.transition("job-two", None, sandbox=handle)
    later = time.time() + get_settings().stage_lease_s + 1
    assert sweep_sandboxes(store, now=later)["sandboxes_closed"] == [f"{host.host_id}/{other.handle.sandbox_id}"]
    assert grader.exec("echo kept").output == "kept\n" and own.exec("echo kept").output == "kept\n"


def test_a_sandbox_whose_job_waits_for_its_next_stage_is_renewed_before_it_lapses(start_host, store):
    """Under bulk load a job can wait for a run worker longer than a sandbox's lease: the sweep
    renews the sandbox of a job between stages, and only of such a job (a running stage renews its
    own; a dead holder is the stage lease's matter)."""
    host = start_host(runtime="local")
    lease = 3 * get_settings().sweep_interval_s  # lapses before the pass after next: not yet
    waiting, running = create(host, "job-waiting", lease_s=lease), create(host, "job-running", lease_s=lease)
    running_job(store, "job-waiting", waiting, stage=JobStatus.INIT)
    store.transition("job-waiting", None, stage_state="done")  # init done, no run worker free yet
    running_job(store, "job-running", running)
    before = {e.job_id: e.expires_at for e in list_sandboxes(host.address, host.token)}
    assert sweep_sandboxes(store)["sandboxes_renewed"] == []  # far from lapsing
    soon = time.time() + lease - get_settings().sweep_interval_s  # as a pass that much later sees it
    report = sweep_sandboxes(store, now=soon)
    assert report["sandboxes_renewed"] == [f"{host.host_id}/{waiting.handle.sandbox_id}"]
    after = {e.job_id: e.expires_at for e in list_sandboxes(host.address, host.token)}
    assert after["job-waiting"] > before["job-waiting"] and after["job-running"] == before["job-running"]
    assert waiting.exec("echo kept").output == "kept\n"


def test_a_host_that_stopped_beating_is_dead_and_its_jobs_run_again(start_host, store, redis_client,
                                                                   redis_url):
    """redis_url: the broker the job's new init message goes to (tasks/retry.py)."""
    survivor, doomed = start_host(runtime="local"), start_host(runtime="local")
    running_job(store, "job-lost", create(doomed, "job-lost"))
    running_job(store, "job-fine", create(survivor, "job-fine"))
    running_job(store, "job-no-sandbox", None, stage=JobStatus.INIT)
    doomed.stop(signal.SIGKILL)
    last_beat = redis_client.zscore(keys.hosts(), doomed.host_id)
    # as seen after 3 missed heartbeats of the dead host, while the survivor keeps beating
    now = last_beat + 3 * get_settings().host_heartbeat_s + 0.5
    redis_client.zadd(keys.hosts(), {survivor.host_id: now})
    report = sweep_sandboxes(store, now=now)
    assert report["hosts_dead"] == [doomed.host_id]
    assert report["jobs_host_lost"] == ["job-lost"]
    assert redis_client.zscore(keys.hosts(), doomed.host_id) is None
    assert redis_client.zscore(keys.hosts(), survivor.host_id) is not None
    record = store.get("job-lost")  # back to queued for its second attempt, from init
    assert record.status is JobStatus.QUEUED and record.attempt == 2 and record.sandbox is None
    assert [(f["attempt"], f["stage"], f["fault"], f["host"]) for f in record.faults] == \
        [(1, "run", "sandbox_host_lost", doomed.host_id)]
    assert store.status("job-fine") is JobStatus.RUN and store.status("job-no-sandbox") is JobStatus.INIT
    # a second sweep, at the real time (the survivor's own heartbeat may have replaced the score
    # the test gave it, so "now" in the future would see the survivor as dead): nothing again
    again = sweep_sandboxes(store)
    assert again["hosts_dead"] == [] and again["jobs_host_lost"] == []


def test_the_beat_sweep_reports_it(start_host, store):
    from tasks.sweep.beat import sweep_once

    host = start_host(runtime="local")
    create(host, "job-gone")
    report = sweep_once(store)
    assert len(report["sandboxes_closed"]) == 1 and live_ids(host) == set()
    assert {"timed_out", "redispatched", "hosts_dead", "jobs_host_lost",
            "instances_stopped"} <= set(report)


STRAYING = "tests.sandboxes.straying:StrayingLocal"


def test_strays_are_found_by_asking_the_hosts_and_those_of_ended_jobs_stopped(start_host, store, tmp_path):
    """The sweep imports no runtime: each host lists its node's strays (its runtimes' hook) and
    stops, on the sweep's word, those whose job is terminal or unknown. Two hosts on one node
    list the same strays: each is stopped once."""
    strays = tmp_path / "strays"
    strays.mkdir()
    for name, job in (("s-ended", "job-ended"), ("s-unknown", "job-nobody"), ("s-running", "job-running"),
                      ("stuck-1", "job-nobody-2")):
        (strays / name).write_text(job)
    running_job(store, "job-running")
    running_job(store, "job-ended")
    finish(store, store.get("job-ended"), JobStatus.CANCELLED, critical_error="cancelled")
    env = {"PRORL_TEST_STRAYS": str(strays)}
    first, second = (start_host(runtimes=STRAYING, env=env) for _ in range(2))
    listed = list_strays(first.address, first.token)
    assert {(s.name, s.job_id, s.runtime) for s in listed} == {
        ("s-ended", "job-ended", STRAYING), ("s-unknown", "job-nobody", STRAYING),
        ("s-running", "job-running", STRAYING), ("stuck-1", "job-nobody-2", STRAYING)}
    report = sweep_sandboxes(store)
    assert sorted(report["instances_stopped"]) == ["s-ended", "s-unknown"]
    assert sorted(p.name for p in strays.iterdir()) == ["s-running", "stuck-1"]  # a failed stop is logged
    assert second.host_id not in report["hosts_unreachable"] and first.host_id not in report["hosts_unreachable"]
    assert sweep_sandboxes(store)["instances_stopped"] == []


def test_a_host_refuses_to_stop_a_stray_of_a_runtime_it_does_not_serve(start_host, tmp_path):
    host = start_host(runtime="local")
    answer = stop_strays(host.address, host.token, [Stray(runtime=STRAYING, name="x", job_id="j")])
    assert answer.stopped == [] and "not served" in answer.failed["x"]
    assert list_strays(host.address, host.token) == []  # local has none
