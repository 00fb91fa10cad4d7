"""Closing sandboxes: ``sandboxes.client.close_handle`` (and its bulk form) against the stack's real
sandbox host, and ``StageContext.close_sandbox`` on a real job store."""
from __future__ import annotations

import logging

import pytest

from prorl_celery import keys
from prorl_celery.connections import get_store
from prorl_celery.errors import SandboxError, SandboxGone
from prorl_celery.ops.procs import free_port
from prorl_celery.jobs import JobRecord
from prorl_celery.status import JobStatus, StageState
from sandboxes.base import SandboxHandle, SandboxSpec
from sandboxes.client import close_handle, close_handles
from tasks.chain import cancel_many, queued_links
from tasks.context import StageContext
from tests.tasks.test_stage_handler import job_running_init

LOCAL = SandboxSpec(runtime="local")


def _unreachable(sandbox_id: str = "sb-nowhere") -> SandboxHandle:
    return SandboxHandle(host_id="gone-host", address=f"http://127.0.0.1:{free_port()}", token="t",
                         sandbox_id=sandbox_id, runtime="local")


def _kept_box(store) -> tuple[str, object]:
    """A sandbox the stack's sweep keeps: its job is running init with a live stage lease (as a
    worker's keeper holds it) and has it on record. A sandbox under a job id the store does not
    know is closed by the next sweep (every second in the tests), which a loaded node lets run
    between the open and the close."""
    job_id = job_running_init(store)
    store.redis.set(keys.stage_lease(job_id), "test", ex=600)
    box = StageContext(store, store.get(job_id), JobStatus.INIT, 30).open_sandbox(LOCAL)
    return job_id, box


def test_close_handle_closes_a_stored_handle_once_then_finds_it_gone(stack):
    store = get_store()
    job_id, box = _kept_box(store)
    try:
        assert close_handle(box.handle.model_dump()) is True  # the dict a job record stores
        assert close_handle(box.handle) is False  # already gone: not an error
        with pytest.raises(SandboxGone):
            box.exec("true")
    finally:
        cancel_many(store, [store.get(job_id)], "test over")


def test_a_sandbox_the_host_called_gone_is_not_closed_again(stack, monkeypatch):
    store = get_store()
    job_id, box = _kept_box(store)
    assert close_handle(box.handle) is True  # as a bulk cancel does, behind the stage's back
    cancel_many(store, [store.get(job_id)], "test over")
    with pytest.raises(SandboxGone):
        box.exec("true")
    assert box.gone
    calls = []
    monkeypatch.setattr("sandboxes.client.request", lambda *a, **k: calls.append(a))
    assert box.close() is False and calls == []  # no second round trip to the host


def test_close_handle_logs_an_unreachable_host_and_raises_only_when_asked(caplog):
    with caplog.at_level(logging.WARNING, logger="sandboxes.client"):
        assert close_handle(_unreachable("sb-unreached").model_dump()) is False
    assert "could not close sandbox sb-unreached" in caplog.text
    with pytest.raises(SandboxError, match="unreachable"):
        close_handle(_unreachable(), raise_errors=True)


def test_close_handles_closes_in_bulk_and_logs_a_host_it_cannot_reach(stack, caplog):
    store = get_store()
    kept = [_kept_box(store) for _ in range(3)]
    boxes = [box for _, box in kept]
    try:
        with caplog.at_level(logging.WARNING, logger="sandboxes.client"):
            closed = close_handles([b.handle.model_dump() for b in boxes] + [_unreachable()])
        assert sorted(closed) == sorted(b.handle.sandbox_id for b in boxes)
        assert "could not close 1 sandboxes" in caplog.text
        assert [close_handle(b.handle) for b in boxes] == [False, False, False]
    finally:
        cancel_many(store, [store.get(job_id) for job_id, _ in kept], "test over")


def test_a_redelivered_init_closes_the_first_attempts_sandbox(stack):
    store = get_store()
    job_id = job_running_init(store)
    store.redis.set(keys.stage_lease(job_id), "test", ex=600)  # a live worker's lease: the sweep waits
    try:
        first = StageContext(store, store.get(job_id), JobStatus.INIT, 30).open_sandbox(LOCAL)
        again = StageContext(store, store.get(job_id), JobStatus.INIT, 30, resumed=True)
        second = again.open_sandbox(LOCAL)
        with pytest.raises(SandboxGone):
            first.exec("true")
        assert second.exec("echo second").output == "second\n"
        assert again.close_sandbox() is True and again.close_sandbox() is False
        # the record keeps the handle: the result and a retry name the attempt's host from it
        assert again.record.sandbox["sandbox_id"] == second.handle.sandbox_id
        with pytest.raises(SandboxGone):
            again.sandbox.exec("true")
    finally:
        cancel_many(store, [store.get(job_id)], "test over")


def _record(status: JobStatus, state: StageState) -> JobRecord:
    return JobRecord(job_id=f"j-{status.value}-{state.value or 'none'}", status=status, stage_state=state,
                     data_source="shell", instance={}, t_created=0.0)


@pytest.mark.unit
def test_a_cancel_revokes_only_the_links_that_may_wait_in_a_queue():
    cases = {  # (status, stage state) -> the link a worker could still take, or none
        (JobStatus.QUEUED, StageState.NONE): "init",
        (JobStatus.INIT, StageState.NONE): "init",  # sent again after a fault, not yet taken
        (JobStatus.INIT, StageState.RUNNING): None,  # runs: ends itself at the store's word
        (JobStatus.INIT, StageState.DONE): "run",  # the chain sent run
        (JobStatus.RUN, StageState.REDISPATCHED): "run",  # the sweep sent it again
        (JobStatus.RUN, StageState.RUNNING): None,
        (JobStatus.EVAL, StageState.RUNNING): None,
        (JobStatus.EVAL, StageState.DONE): None,  # nothing follows eval
    }
    for (status, state), link in cases.items():
        record = _record(status, state)
        assert queued_links([record]) == ([f"{record.job_id}:{link}"] if link else []), (status, state)
