"""The audit run: for each task, the no-op agent and each hack policy as the agent, through the
service (its API, workers, sandboxes and the task's own grader), then a verdict per task.

It talks to the API only (``prorl_celery.client.ProrlClient`` or anything with its ``submit_many``,
``as_completed`` and ``cancel``): every run is an ordinary job, graded as a training job would be."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tasks.audit import quarantine
from tasks.audit.policies import NOOP, Policy
from tasks.audit.taskset import AuditTask
from tasks.audit.verdict import TaskVerdict, evidence, judge

Progress = Callable[[int, int], None]  # (jobs done, jobs in all)


def jobs_for(tasks: list[AuditTask], policies: list[Policy]) -> list[tuple[int, str, dict[str, Any]]]:
    """(task index, policy name, job request) for the no-op and each policy on each task."""
    out = []
    for i, task in enumerate(tasks):
        for policy in [NOOP, *policies]:
            out.append((i, policy.name, {"instance": {**task.instance, "agent": policy.agent()},
                                         "sampling_params": {}}))
    return out


def run_audit(client: Any, tasks: list[AuditTask], policies: list[Policy], progress: Progress | None = None,
              timeout: float | None = None) -> list[TaskVerdict]:
    """Submit every run, wait for all, and judge each task (its content hash and grader version
    recorded, for the quarantine)."""
    from prorl_celery.client import ProrlClientError
    from prorl_celery.errors import ProrlError

    owner: dict[str, tuple[int, str]] = {}
    refused: dict[int, str] = {}
    for i, task in enumerate(tasks):  # a task at a time: one the service refuses is said so, not fatal
        chunk = jobs_for([task], policies)
        try:
            ids = client.submit_many([job for _, _, job in chunk])
        except (ProrlError, ProrlClientError) as exc:
            refused[i] = f"refused at submission: {exc}"
            continue
        owner.update({job_id: (i, name) for job_id, (_, name, _) in zip(ids, chunk)})
    finished: dict[tuple[int, str], dict[str, Any]] = {}
    if progress:
        progress(0, len(owner))
    try:
        for job in client.as_completed(list(owner), timeout=timeout):
            finished[owner[job["job_id"]]] = job
            if progress:
                progress(len(finished), len(owner))
    except BaseException:
        for job_id in set(owner) - {j["job_id"] for j in finished.values()}:
            try:
                client.cancel(job_id)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        raise
    verdicts = []
    for i, task in enumerate(tasks):
        if i in refused:
            verdicts.append(TaskVerdict(task=task.name, data_source=task.instance["data_source"], hackable=False,
                                        note=refused[i]))
            continue
        noop = evidence(NOOP.name, finished[(i, NOOP.name)])
        runs = [evidence(p.name, finished[(i, p.name)]) for p in policies]
        verdict = judge(task.name, task.instance["data_source"], noop, runs)
        verdict.content_hash = quarantine.content_hash(task.instance)
        verdict.grader_version = quarantine.grader_version(task.instance["data_source"])
        verdicts.append(verdict)
    return verdicts
