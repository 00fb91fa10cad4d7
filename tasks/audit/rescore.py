"""Re-score kept results through today's graders (``prorl-celery rescore``); a replayed grade is
a new job or an in-process grade, and the stored original is never touched.

What a result keeps decides how it is replayed, per domain:

- **SWE** (a result with ``git_patch``, kept in the job record): a new job of the job's own
  instance with the ``replay`` harness as the agent, which applies the diff; today's grader
  grades it in a fresh checkout.
- **Harbor**: each step's final workspace diff against the task's image, kept apart in Redis
  (:mod:`tasks.harbor.keep`); a new job of the same task whose ``replay`` agent restores it per
  step, then the task's verifier runs as usual.
- **Answer domains** (math, stem, echo, lookup, ...: graded on the final answer): the stored answer
  (the job's state) re-graded by today's handler in this process (:mod:`tasks.audit.regrade`), no
  job, sandbox or LLM call; where the grader needs a sandbox (``code``), a new job whose ``replay``
  agent holds the stored answer, graded by the workers.

All of it for ``rescore_retention_s`` after the job finished (default: the job's TTL; 0: none)."""
from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, Field

from config.settings import Settings, get_settings, rescore_retention_s
from tasks.audit.taskset import AGENT_KEYS

EPS = 1e-9


class Rescored(BaseModel):
    job_id: str
    data_source: str
    original: float | None = Field(None, description="The stored reward.")
    today: float | None = Field(None, description="Today's grader's reward on the same workspace or answer (None: not replayed or a fault).")
    changed: bool = False
    how: str | None = Field(None, description="How it was replayed: a job (swe diff, harbor workspace) or in process (answer).")
    replay_job: str | None = None
    note: str | None = Field(None, description="Why it was not replayed, or the replay's error type.")


def _canonical(record: Any) -> str:
    from tasks.handlers import HANDLERS

    return HANDLERS.canonical(record.data_source)


def _harbor(record: Any) -> bool:
    return _canonical(record) == "harbor" or "harbor" in (record.result or {})


def _without_agent(record: Any) -> dict[str, Any]:
    return {k: v for k, v in record.instance.items() if k not in AGENT_KEYS}


def _harbor_instance(record: Any, redis: Any) -> tuple[dict[str, Any] | None, str | None]:
    from tasks.harbor import keep
    from tasks.harnesses.replay import workspaces_of

    steps = ((record.result or {}).get("harbor") or {}).get("steps") or []
    kept = keep.load(redis, record.job_id) if redis is not None else {}
    for i, step in enumerate(steps):
        if i not in kept:
            why = (step.get("kept") or {}).get("workspace")
            return None, (f"step {i}'s workspace was not kept ({why})" if isinstance(why, str) and why.startswith("no")
                          else f"step {i}'s workspace is not kept (expired, or from before workspaces were kept)")
    if not steps:
        return None, "the result graded no step"
    return {**_without_agent(record), "agent": {"harness": "replay", "workspaces": workspaces_of(kept)}}, None


def replay_instance(record: Any, redis: Any = None, settings: Settings | None = None,
                    now: float | None = None) -> tuple[dict[str, Any] | str | None, str | None]:
    """(the instance of a job that replays the record, None), ("answer", None) for an answer
    re-graded in process, or (None, why it cannot be replayed)."""
    settings = settings or get_settings()
    result = record.result or {}
    if record.status.value != "completed":
        return None, f"the job ended {record.status.value}: no graded workspace"
    retention = rescore_retention_s(settings)
    age = (now or time.time()) - (record.t_finished or now or time.time())
    if retention <= 0 or age > retention:
        return None, f"finished {age:.0f}s ago, past the re-scoring retention (rescore_retention_s={retention})"
    patch = result.get("git_patch")
    if isinstance(patch, str):
        return {**_without_agent(record), "agent": {"harness": "replay", "patch": patch}}, None
    if _harbor(record):
        return _harbor_instance(record, redis)
    if _canonical(record) == "swe":
        return None, "the result keeps no workspace diff (git_patch) to replay"
    return "answer", None


def _compare(row: Rescored, today: float) -> None:
    row.today = today
    row.changed = abs(today - (row.original or 0.0)) > EPS


HOW = {"patch": "swe diff, new job", "workspaces": "harbor workspace, new job", "final_text": "answer, new job"}


def _plan(row: Rescored, record: Any, redis: Any) -> dict[str, Any] | None:
    """Fill ``row`` for a result re-graded in process (or not at all); the instance of the new
    job that replays it otherwise."""
    from tasks.audit.regrade import NeedsStage, answer_instance, regrade

    instance, row.note = replay_instance(record, redis)
    if instance != "answer":
        return instance if isinstance(instance, dict) else None
    try:
        today, row.note = regrade(record)
    except NeedsStage:  # its grader runs tests in a sandbox: the answer replayed as a job
        instance, row.note = answer_instance(record)
        return instance
    row.how = "answer, in process"
    if today is not None:
        _compare(row, today)
    return None


def rescore(client: Any, store: Any, job_ids: list[str], timeout: float | None = None) -> list[Rescored]:
    """Replay each job from its record (``store``: the job store; its Redis holds the kept
    workspaces) through the service (``client``: the API) or in process, and compare rewards."""
    out: dict[str, Rescored] = {}
    replays: dict[str, str] = {}
    for job_id in job_ids:
        record = store.get(job_id)
        if record is None:
            out[job_id] = Rescored(job_id=job_id, data_source="?", note="no such job (expired, or never stored)")
            continue
        original = (record.result or {}).get("reward")
        row = out[job_id] = Rescored(job_id=job_id, data_source=record.data_source,
                                     original=None if original is None else float(original))
        instance = _plan(row, record, store.redis)
        if instance is None:
            continue
        row.how = next(how for key, how in HOW.items() if key in instance["agent"])
        try:
            row.replay_job = client.submit(instance)
        except Exception as exc:  # noqa: BLE001 - e.g. a task quarantined since (409): said on its row
            row.note = f"the replay was refused: {exc}"[:300]
            continue
        replays[row.replay_job] = job_id
    for job in client.as_completed(list(replays), timeout=timeout) if replays else []:
        row = out[replays[job["job_id"]]]
        result = job.get("result") or {}
        if job.get("status") == "completed" and result.get("reward") is not None:
            _compare(row, float(result["reward"]))
        else:
            row.note = f"the replay ended {job.get('status')}: {(result.get('error') or {}).get('type')}"
    return [out[j] for j in job_ids]
