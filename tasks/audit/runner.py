"""The audit run: for each task, the no-op agent and each hack policy as the agent, through the
service (its API, workers, sandboxes and the task's own grader), then a verdict per task.

It talks to the API only (``prorl_celery.client.ProrlClient`` or anything with its ``submit_many``,
``as_completed`` and ``cancel``): every run is an ordinary job, graded as a training job would be."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tasks.audit import quarantine
from tasks.audit.policies import NOOP, Policy
from tasks.audit.taskset import AuditTask
from tasks.audit.verdict import TaskVerdict, evidence, judge

Progress = Callable[[int, int], None]  # (jobs done, jobs in all)


# The stage budget of a policy's run: a grader that waits out its stage on code that never returns
# (resource_exhaust) would hold a worker slot for the service's whole budget (SWE, code: the eval
# stage, 1200 s; Harbor, whose verifier runs in the run stage: the task's verifier timeout, 600 s in
# the Harbor set). The no-op's own time in that stage times this, at least the floor, caps it; a run
# cut there is a fault (a timeout), never a reward, and the verdict counts it.
STAGE_FACTOR = 4.0
STAGE_FLOOR_S = 120.0
RUN_STAGE_GRADED = ("harbor",)  # graded within the run stage, step by step


def graded_by(jobs: list[dict[str, Any]], data_source: str) -> str:
    """The version of the grader that graded the task's runs, as their results say (a Harbor
    result's ``harbor.grader_version``: the workers' code, which may differ from this process's);
    this process's own where none says. Runs graded by different versions: ``mixed <versions>``,
    current for no grader, so the verdict quarantines nothing until the task is audited again."""
    said = {str(v) for job in jobs
            if isinstance(harbor := (job.get("result") or {}).get("harbor"), dict)
            and (v := harbor.get("grader_version")) is not None}
    if not said:
        return quarantine.grader_version(data_source)
    return said.pop() if len(said) == 1 else "mixed " + ",".join(sorted(said))


def stage_budget(data_source: str, noop_job: dict[str, Any] | None) -> dict[str, float]:
    """The sampling parameters that bound the policies' runs on a task, from its no-op's job
    (``{}``: the service's own budgets, when the no-op did not finish)."""
    if not noop_job or noop_job.get("status") != "completed":
        return {}
    stage = "run" if data_source in RUN_STAGE_GRADED else "eval"
    spent = float((noop_job.get("timings") or {}).get(stage) or 0.0)
    return {f"{stage}_budget_s": round(max(STAGE_FLOOR_S, STAGE_FACTOR * spent), 1)}


def jobs_for(tasks: list[AuditTask], policies: list[Policy], budget: dict[str, float] | None = None,
             noop: bool = True) -> list[tuple[int, str, dict[str, Any]]]:
    """(task index, policy name, job request) for the no-op (``noop``) and each policy on each task."""
    out = []
    for i, task in enumerate(tasks):
        for policy in [NOOP, *policies] if noop else policies:
            sampling = dict(budget or {}) if policy is not NOOP else {}
            out.append((i, policy.name, {"instance": {**task.instance, "agent": policy.agent()},
                                         "sampling_params": sampling}))
    return out


class _Runs:
    """The submitted runs: their owners, the finished jobs, the progress."""

    def __init__(self, client: Any, total: int, progress: Progress | None, timeout: float | None):
        self.client, self.total, self.progress, self.timeout = client, total, progress, timeout
        self.owner: dict[str, tuple[int, str]] = {}
        self.finished: dict[tuple[int, str], dict[str, Any]] = {}
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def submit(self, chunk: list[tuple[int, str, dict[str, Any]]]) -> None:
        ids = self.client.submit_many([job for _, _, job in chunk])
        self.owner.update({job_id: (i, name) for job_id, (i, name, _) in zip(ids, chunk)})

    def wait(self, ids: list[str]) -> None:
        left = None if self.deadline is None else max(1.0, self.deadline - time.monotonic())
        try:
            for job in self.client.as_completed(ids, timeout=left):
                self.finished[self.owner[job["job_id"]]] = job
                if self.progress:
                    self.progress(len(self.finished), self.total)
        except BaseException:
            done = {j["job_id"] for j in self.finished.values()}
            for job_id in set(self.owner) - done:
                try:
                    self.client.cancel(job_id)
                except Exception:  # noqa: BLE001 - best effort on the way out
                    pass
            raise


def run_audit(client: Any, tasks: list[AuditTask], policies: list[Policy], progress: Progress | None = None,
              timeout: float | None = None) -> list[TaskVerdict]:
    """The no-op on every task first, then every policy (a task whose grader would wait out its
    stage budget gets the policies' budget from its no-op's: :func:`stage_budget`), all waited
    for, and a verdict per task (its content hash and grader version recorded, for the quarantine)."""
    from prorl_celery.client import ProrlClientError
    from prorl_celery.errors import ProrlError

    refused: dict[int, str] = {}
    runs = _Runs(client, len(tasks) * (1 + len(policies)), progress, timeout)
    for i, task in enumerate(tasks):  # a task at a time: one the service refuses is said so, not fatal
        try:
            runs.submit([(i, NOOP.name, job) for _, _, job in jobs_for([task], [])])
        except (ProrlError, ProrlClientError) as exc:
            refused[i] = f"refused at submission: {exc}"
    runs.total = (len(tasks) - len(refused)) * (1 + len(policies))
    if progress:
        progress(0, runs.total)
    runs.wait(list(runs.owner))
    policy_ids: list[str] = []
    for i, task in enumerate(tasks):
        if i in refused or not policies:
            continue
        budget = stage_budget(task.instance["data_source"], runs.finished.get((i, NOOP.name)))
        chunk = [(i, name, job) for _, name, job in jobs_for([task], policies, budget, noop=False)]
        before = set(runs.owner)
        try:
            runs.submit(chunk)
        except (ProrlError, ProrlClientError) as exc:
            refused[i] = f"refused at submission: {exc}"
            continue
        policy_ids += sorted(set(runs.owner) - before)
    runs.wait(policy_ids)
    verdicts = []
    for i, task in enumerate(tasks):
        if i in refused:
            verdicts.append(TaskVerdict(task=task.name, data_source=task.instance["data_source"], hackable=False,
                                        note=refused[i]))
            continue
        noop = evidence(NOOP.name, runs.finished[(i, NOOP.name)])
        evs = [evidence(p.name, runs.finished[(i, p.name)]) for p in policies]
        verdict = judge(task.name, task.instance["data_source"], noop, evs)
        verdict.content_hash = quarantine.content_hash(task.instance)
        verdict.grader_version = graded_by([runs.finished[(i, NOOP.name)], *(runs.finished[(i, p.name)] for p in policies)],
                                           task.instance["data_source"])
        verdicts.append(verdict)
    return verdicts
