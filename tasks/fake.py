"""``FakeStage``: what a handler sees of its stage (:class:`tasks.context.StageContext`), in
process, recording what the handler asks of it.

The surface a handler uses, and only that: ``job_id``, ``instance``, ``sampling_params``,
``state``, ``resumed``, ``remaining``/``check``/``stopped`` (a budget and a cancel flag), ``admit``
(admission control: counted in ``admissions``; a cancelled job raises),
``save``/``flush`` (each save kept as a copy of ``state``), ``transcript``, ``open_sandbox`` (the
specs asked for are kept; each opens the next of the given sandboxes, by default a new
:class:`~sandboxes.fake.DummySandbox`), ``close_sandbox``, ``sandbox`` and ``agent``
(the built-in agent with a :class:`~prorl_celery.fakes.policy.ScriptedPolicy` as its policy).
As the real context, a save after the job was cancelled raises :class:`JobCancelled` and keeps
nothing, and ``sandbox`` without an opened one is an error.
"""
from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prorl_celery.errors import JobCancelled, StageBudgetExceeded
from sandboxes.fake import DummySandbox
from prorl_celery.jobstate import AGENT_KEY, JobState
from prorl_celery.rollout.transcript import Transcript

if TYPE_CHECKING:
    from prorl_celery.fakes.policy import ScriptedPolicy
    from sandboxes.base import SandboxSpec
    from tasks.agent import AgentConfig, DefaultAgent


class FakeStage:
    def __init__(self, instance: dict[str, Any], *, sampling_params: dict[str, Any] | None = None,
                 state: dict[str, Any] | None = None, policy: ScriptedPolicy | None = None,
                 sandboxes: Iterable[DummySandbox] = (), budget_s: float = math.inf, resumed: bool = False,
                 job_id: str = "fake-job", sandbox: DummySandbox | None = None):
        self.job_id = job_id
        self.instance = instance
        self.sampling_params = dict(sampling_params or {})
        self.state = JobState.of(copy.deepcopy(state or {}))
        self.policy = policy
        self.resumed = resumed
        self.deadline = time.monotonic() + budget_s
        self.cancelled = False
        self.admissions = 0
        self.transcript = Transcript()
        self.saves: list[dict[str, Any]] = []  # ``state`` as each save stored it
        self.opened: list[SandboxSpec] = []  # the specs the handler asked for, in order
        self.closed: list[DummySandbox] = []
        self._next = list(sandboxes)
        self._sandbox = sandbox  # a sandbox an earlier stage opened (the record's handle)

    # -- budget and cancellation ---------------------------------------------------------------
    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def check(self) -> None:
        if self.cancelled:
            raise JobCancelled(f"job {self.job_id} was cancelled")
        if self.remaining() <= 0:
            raise StageBudgetExceeded("the stage exceeded its budget")

    def stopped(self) -> bool:
        return self.cancelled

    def admit(self) -> None:
        if self.cancelled:
            raise JobCancelled(f"job {self.job_id} ended while held by admission control")
        self.admissions += 1

    # -- saving ---------------------------------------------------------------------------------
    def save(self) -> None:
        if self.cancelled:
            raise JobCancelled(f"job {self.job_id} ended while in this stage")
        self.saves.append(copy.deepcopy(self.state.dump()))
        self.transcript.mark_saved()

    def flush(self) -> None:
        if self.transcript.has_pending():
            self.save()

    # -- sandbox --------------------------------------------------------------------------------
    def open_sandbox(self, spec: SandboxSpec) -> DummySandbox:
        self.close_sandbox()
        self.opened.append(spec)
        self._sandbox = self._next.pop(0) if self._next else DummySandbox()
        return self._sandbox

    def close_sandbox(self) -> bool:
        box, self._sandbox = self._sandbox, None
        if box is None or box.closed:
            return False
        box.close()
        self.closed.append(box)
        return True

    @property
    def sandbox(self) -> DummySandbox:
        if self._sandbox is None:
            raise RuntimeError("this job has no sandbox; open one in init")
        return self._sandbox

    # -- the agent ------------------------------------------------------------------------------
    def agent(self, config: AgentConfig, pool: Any = None) -> DefaultAgent:
        from tasks.agent import DefaultAgent

        if self.policy is None:
            raise RuntimeError("FakeStage(policy=...) plays the model; none was given")
        return DefaultAgent(self.policy, self.sandbox, config, control=self, sink=self,
                            state=self.state.setdefault(AGENT_KEY, {}), transcript=self.transcript)
