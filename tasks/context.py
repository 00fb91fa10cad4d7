"""What a handler sees while one of its stages runs."""
from __future__ import annotations

import logging
import time
from typing import Any

from prorl_celery.errors import JobCancelled, StageBudgetExceeded
from prorl_celery.jobs import JobRecord, JobStore
from prorl_celery.status import JobStatus
from sandboxes.base import SandboxHandle, SandboxSpec

log = logging.getLogger(__name__)
SANDBOX_KEY = "_sandbox"  # in ctx.state: the result's ``sandbox`` block
INIT_WAIT_KEY = "_init_wait_s"  # in ctx.state: seconds init waited for a sandbox (timings.init_wait)


class StageContext:
    """One stage of one job: its record, its budget, its sandbox, and a place to keep state.

    ``state`` is saved to the job store by :meth:`save`, so a stage that is delivered again after
    its worker died starts from the last saved state.
    """

    def __init__(self, store: JobStore, record: JobRecord, stage: JobStatus, budget_s: float,
                 resumed: bool = False):
        self.store = store
        self.record = record
        self.stage = stage
        self.resumed = resumed
        self.started = time.monotonic()
        self.deadline = self.started + budget_s
        self.state: dict[str, Any] = dict(record.state)
        self._sandbox = None

    @property
    def job_id(self) -> str:
        return self.record.job_id

    @property
    def instance(self) -> dict[str, Any]:
        return self.record.instance

    @property
    def sampling_params(self) -> dict[str, Any]:
        return self.record.sampling_params

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def check(self) -> None:
        """Raise if the job was cancelled (or ended, or was sent back to init, elsewhere) or the
        stage ran out of budget."""
        if self.stopped():
            raise JobCancelled(f"job {self.job_id} left {self.stage} ({self.store.status(self.job_id)}) "
                               f"while this delivery ran it")
        if self.remaining() <= 0:
            raise StageBudgetExceeded(f"{self.stage} stage exceeded its budget")

    def stopped(self) -> bool:
        """True once the job ended elsewhere (cancelled, or ended by the sweep) or left this
        stage (the sweep sent it back to init: its sandbox host died); never raises."""
        status = self.store.status(self.job_id)
        return status is None or status is not self.stage

    def save(self) -> None:
        """Persist ``state``; raises :class:`JobCancelled` if the job ended meanwhile."""
        ok, _ = self.store.transition(self.job_id, None, sources=[self.stage], require_state="running",
                                      expect={"attempt": self.record.attempt}, state=self.state)
        if not ok:
            raise JobCancelled(f"job {self.job_id} ended or left {self.stage} while in it")

    # -- sandbox --------------------------------------------------------------------------
    def open_sandbox(self, spec: SandboxSpec):
        """Start a sandbox on the least-loaded live host and record its handle in the job.

        A full cluster, a transient create failure or an image still being pulled is waited
        out (cancellable, bounded: sandboxes.client.open_sandbox_waiting); the wait is kept for
        the job's ``timings.init_wait``. The limits are
        put under the operator's ceilings here (and again by the host); what the host started
        (runtime, isolation, limits) is kept in ``state["_sandbox"]`` for the result."""
        from sandboxes.client import close_handle, open_sandbox_waiting
        from sandboxes.policy import clamp_spec
        from sandboxes.protocol import sandbox_block

        spec = clamp_spec(spec)

        self.close_sandbox()  # a redelivered init must not leave the first attempt's sandbox
        box, waited = open_sandbox_waiting(self.store.redis, spec, self.job_id,
                                           budget_s=self.remaining(), check=self.check)
        self.state[INIT_WAIT_KEY] = round(self.state.get(INIT_WAIT_KEY, 0.0) + waited, 3)
        handle = box.handle.model_dump()
        ok, _ = self.store.transition(self.job_id, None, sources=[self.stage],
                                      expect={"attempt": self.record.attempt}, sandbox=handle)
        if not ok:
            close_handle(box.handle)
            raise JobCancelled(f"job {self.job_id} ended while its sandbox started")
        self.record.sandbox = handle
        self._sandbox = box
        if box.entry is not None:
            self.state[SANDBOX_KEY] = sandbox_block(box.entry)
        return box

    def close_sandbox(self) -> None:
        """Close the job's sandbox if it has one; closing twice is harmless. Never raises: a host
        that cannot be reached now kills the sandbox itself when its lease lapses (or died with
        it), and a failure here must not hide the job's own outcome."""
        from sandboxes.client import close_handle

        if not self.record.sandbox:
            return
        try:
            close_handle(SandboxHandle.model_validate(self.record.sandbox))
        except Exception as exc:  # noqa: BLE001 - see above
            log.warning("job %s: could not close sandbox %s: %s", self.job_id,
                        self.record.sandbox.get("sandbox_id"), exc)

    @property
    def sandbox(self):
        """The job's sandbox, driven by its handle (it may live on another node)."""
        from sandboxes.client import RemoteSandbox

        if self._sandbox is None:
            if not self.record.sandbox:
                raise RuntimeError("this job has no sandbox; open one in init")
            self._sandbox = RemoteSandbox(SandboxHandle.model_validate(self.record.sandbox))
        return self._sandbox
