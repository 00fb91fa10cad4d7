"""Groups: n samples of one prompt, read and cancelled together; and cancelling everything."""
from __future__ import annotations

import statistics
import uuid
from typing import Annotated, Any

from flask import Blueprint, current_app, jsonify
from pydantic import BaseModel, ConfigDict, Field

from flask_api import schemas as s
from flask_api.errors import parse_body
from flask_api.jobs import check_handlers
from flask_api.routes import route
from flask_api.tenancy import caller, own
from prorl_celery.errors import UnknownGroup
from prorl_celery.jobs import JobStore
from prorl_celery.models import Instance, JobRequest, SamplingParams
from tasks.chain import active_jobs, cancel_many, submit

bp = Blueprint("groups", __name__)


class GroupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    instance: Instance
    sampling_params: SamplingParams = Field(default_factory=dict)
    n: int = Field(ge=1, le=1024, description="Number of samples; each gets trajectory_id 0..n-1 (at most 1,024: one request writes them all).")
    group_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,100}$")] | None = Field(
        None, description="Client-chosen id; resubmitting it with the same request runs nothing new; another instance or sampling set under it is 409.")
    priority: int = Field(0, ge=-1000, le=1000, description="Each sample's priority within its project (as a job's).")

    def jobs(self) -> list[JobRequest]:
        gid = self.group_id = self.group_id or uuid.uuid4().hex
        return [JobRequest(instance={**self.instance, "trajectory_id": i}, sampling_params=self.sampling_params,
                           job_id=f"{gid}-{i}", group_id=gid, priority=self.priority) for i in range(self.n)]


class CancelAllRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    group_id: str | None = Field(None, description="Only jobs of this group.")
    data_source: str | None = Field(None, description="Only jobs of this data source.")


def _store() -> JobStore:
    return current_app.extensions["prorl_store"]


@route(bp, "post", "/groups", "Submit n samples of one prompt",
       {202: s.GroupSubmitResponse, 400: s.ErrorBody, 403: s.ErrorBody, 409: s.ErrorBody,
        429: s.ErrorBody}, body=GroupRequest,
       tag="groups")
def submit_group():
    body: GroupRequest = parse_body(GroupRequest)
    jobs = body.jobs()
    warnings = check_handlers(jobs)
    return jsonify({"group_id": body.group_id, "job_ids": submit(_store(), jobs, project=caller()),
                    **({"warnings": warnings} if warnings else {})}), 202


@route(bp, "get", "/groups/{group_id}", "Each sample's status; reward statistics once complete",
       {200: s.GroupView, 404: s.ErrorBody}, tag="groups")
def get_group(group_id: str):
    store = _store()
    records = own(store.get_many(store.group_ids(group_id)))
    if not records:
        raise UnknownGroup(group_id)
    records.sort(key=lambda r: (r.instance.get("trajectory_id", 0), r.job_id))
    complete = all(r.status.terminal for r in records)
    samples = [{"job_id": r.job_id, "status": r.status.value,
                "reward": (r.result or {}).get("reward")} for r in records]
    body = {"group_id": group_id, "n": len(records), "complete": complete, "samples": samples,
            "counts": _count(s["status"] for s in samples)}
    if complete:
        rewards = [s["reward"] for s in samples if s["status"] == "completed" and s["reward"] is not None]
        body["rewards"] = _stats(rewards)
    return jsonify(body)


@route(bp, "delete", "/groups/{group_id}", "Cancel a group", {200: s.GroupCancelResponse, 404: s.ErrorBody},
       tag="groups")
def cancel_group(group_id: str):
    store = _store()
    records = own(store.get_many(store.group_ids(group_id)))
    if not records:
        raise UnknownGroup(group_id)
    cancelled = cancel_many(store, records, reason=f"group {group_id} cancelled")
    return jsonify({"group_id": group_id, "cancelled": cancelled})


@route(bp, "post", "/cancel_all", "Cancel every active job of the caller's project (the operator's token: "
       "everyone's), optionally of a group or data source",
       {200: s.CancelAllResponse, 400: s.ErrorBody}, body=CancelAllRequest, tag="groups")
def cancel_all():
    body: CancelAllRequest = parse_body(CancelAllRequest)
    records = [r for r in own(active_jobs(_store()))
               if (body.group_id is None or r.group_id == body.group_id)
               and (body.data_source is None or r.data_source == body.data_source)]
    cancelled = cancel_many(_store(), records, reason="cancel_all")
    return jsonify({"cancelled": len(cancelled), "job_ids": cancelled})


def _count(statuses) -> dict[str, int]:
    out: dict[str, int] = {}
    for status in statuses:
        out[status] = out.get(status, 0) + 1
    return out


def _stats(rewards: list[float]) -> dict[str, Any]:
    if not rewards:
        return {"count": 0, "mean": None, "std": None, "min": None, "max": None, "all_equal": None}
    return {"count": len(rewards), "mean": statistics.fmean(rewards), "std": statistics.pstdev(rewards),
            "min": min(rewards), "max": max(rewards), "all_equal": len(set(rewards)) == 1}
