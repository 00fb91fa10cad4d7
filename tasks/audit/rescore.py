"""Re-score kept results: each finished job's final workspace diff replayed as the agent (the
``replay`` harness) on the job's own instance, graded by today's grader in a new job (the stored
original is never touched), and every reward that changes reported.

What a result keeps decides what can be replayed: a SWE result's ``git_patch`` (kept with the
job for the job store's retention). A result without one (a Harbor task's workspace is not kept,
an answer domain's answer is graded in place) is reported as not replayable, with the reason."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from tasks.audit.taskset import AGENT_KEYS

EPS = 1e-9


class Rescored(BaseModel):
    job_id: str
    data_source: str
    original: float | None = Field(None, description="The stored reward.")
    today: float | None = Field(None, description="Today's grader's reward on the same workspace (None: not replayed or a fault).")
    changed: bool = False
    replay_job: str | None = None
    note: str | None = Field(None, description="Why it was not replayed, or the replay's error type.")


def replay_instance(record: Any) -> tuple[dict[str, Any] | None, str | None]:
    """(the instance that replays the record's workspace, None) or (None, why it cannot)."""
    result = record.result or {}
    if record.status.value != "completed":
        return None, f"the job ended {record.status.value}: no graded workspace"
    patch = result.get("git_patch")
    if not isinstance(patch, str):
        return None, "the result keeps no workspace diff (git_patch) to replay"
    instance = {k: v for k, v in record.instance.items() if k not in AGENT_KEYS}
    return {**instance, "agent": {"harness": "replay", "patch": patch}}, None


def rescore(client: Any, store: Any, job_ids: list[str], timeout: float | None = None) -> list[Rescored]:
    """Replay each job through the service (``client``: the API) from its record (``store``:
    the job store) and compare the rewards."""
    out: dict[str, Rescored] = {}
    replays: dict[str, str] = {}
    for job_id in job_ids:
        record = store.get(job_id)
        if record is None:
            out[job_id] = Rescored(job_id=job_id, data_source="?", note="no such job (expired, or never stored)")
            continue
        original = (record.result or {}).get("reward")
        row = Rescored(job_id=job_id, data_source=record.data_source,
                       original=None if original is None else float(original))
        instance, why = replay_instance(record)
        if instance is None:
            row.note = why
        else:
            row.replay_job = client.submit(instance)
            replays[row.replay_job] = job_id
        out[job_id] = row
    for job in client.as_completed(list(replays), timeout=timeout) if replays else []:
        row = out[replays[job["job_id"]]]
        result = job.get("result") or {}
        if job.get("status") == "completed" and result.get("reward") is not None:
            row.today = float(result["reward"])
            row.changed = abs(row.today - (row.original or 0.0)) > EPS
        else:
            row.note = f"the replay ended {job.get('status')}: {(result.get('error') or {}).get('type')}"
    return [out[j] for j in job_ids]
