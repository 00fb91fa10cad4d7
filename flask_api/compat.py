"""The reference system's endpoints, for trainers written against it (veRL, NeMo RL recipes).

``/process`` runs a new job on every call, as the reference does: its ``job_id`` is a label, not
an idempotency key (NeMo Gym sends the instance id for every sample of a GRPO group and again at
every step), and ``/cancel {job_id}`` reaches every job running under it. Each job's own id is the
label, a dot and 16 hex digits (the answer's ``job_id``). It blocks until the rollout ends, like
the reference, but the job lives in the job store: if the HTTP connection drops, the result is
still there under its own id (``GET /jobs/<id>``). Past ``2 x budget + 10 s`` the job is cancelled
and the answer is 504, as in the reference.

Its answer is our result plus the reference system's fields, in the shape NeMo Gym's
``prorl_agent`` (NeMo RL's way in) converts for training: ``messages`` whose assistant turns carry
``input_ids`` (the exact prompt ids of that turn), ``token_ids`` and ``logprobs`` and flat
``tool_calls``; ``tools`` (the OpenAI tool definitions the agent was given); ``resolved``,
``success``, ``finish``, ``end_properly``, ``filter`` (booleans), ``git_patch`` (text),
``critical_error`` and ``error`` (text or null; our structured error stays in ``error_info``).
``GET /jobs/<id>`` keeps the native shape.
"""
from __future__ import annotations

import uuid
from typing import Any

from flask import Blueprint, current_app, jsonify
from pydantic import BaseModel, ConfigDict, Field

from config.settings import get_settings
from flask_api import schemas as s
from flask_api.compat_store import CompatState
from flask_api.errors import error_response, parse_body
from flask_api.jobs import check_handlers
from flask_api.limits import acquire_stream
from flask_api.routes import route
from flask_api.tenancy import caller, own
from prorl_celery.errors import InvalidRequest, JobAlreadyTerminal, UnknownJob
from prorl_celery.jobs import JobRecord, JobStore
from prorl_celery.llm import Turn
from prorl_celery.models import Instance, JobId, JobRequest, SamplingParams
from prorl_celery.rollout.reference import reference_messages
from prorl_celery.rollout.results import TRAJECTORY_KEY
from prorl_celery.rollout.store import Call, RolloutStore
from prorl_celery.rollout.transcript import turns_of
from prorl_celery.rollout.views import expand_result
from tasks.agent import tools as agent_tools
from tasks.chain import cancel, cancel_many, submit

bp = Blueprint("compat", __name__)


class ProcessRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    instance: Instance
    sampling_params: SamplingParams = Field(default_factory=dict)
    job_id: JobId | None = Field(None, description="A label for the new job (every call runs one), "
                                 "which /cancel takes; the job's own id starts with it.")


class CancelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_id: str


def _store() -> JobStore:
    return current_app.extensions["prorl_store"]


def _state() -> CompatState:
    return CompatState(_store().redis, caller())


@route(bp, "post", "/start", "Reference API: start accepting /process", {200: s.CompatStartResponse, 400: s.ErrorBody},
       tag="reference")
def start():
    if not _state().start():
        return error_response(400, "already_running", "the service is already started")
    return jsonify({"status": "running"})


@route(bp, "post", "/stop", "Reference API: stop, cancelling jobs started by /process",
       {200: s.CompatStopResponse}, tag="reference")
def stop():
    """Stop accepting /process and cancel every job that /process started and is still running."""
    store = _store()
    records = own(store.get_many(_state().stop()))
    cancelled = cancel_many(store, records, reason="stopped by /stop")
    return jsonify({"status": "stopped", "cancelled": len(cancelled)})


@route(bp, "get", "/status", "Reference API: counts of jobs", {200: s.CompatStatus}, tag="reference")
def status():
    counts = _store().counts(caller())
    active = counts["init"] + counts["run"] + counts["eval"]
    return jsonify({"status": "running" if _state().running() else "stopped", "pending_jobs": counts["queued"],
                    "running": active, "jobs": counts["queued"] + active, "init": counts["init"],
                    "run": counts["run"], "eval": counts["eval"], "counts": counts})


def _budget_s(params: dict[str, Any]) -> float:
    settings = get_settings()
    if params.get("timeout"):
        return float(params["timeout"])
    return sum(float(params.get(f"{s}_budget_s") or getattr(settings, f"{s}_budget_s"))
               for s in ("init", "run", "eval"))


def _run_id(label: str | None) -> str:
    """A new job id for one ``/process``: the client's ``job_id`` is a label (NeMo Gym sends the
    instance id for every sample of a group and every step), so each call runs a job of its own,
    whose id starts with the label."""
    return f"{label[:100]}.{uuid.uuid4().hex[:16]}" if label else uuid.uuid4().hex


@route(bp, "post", "/process", "Reference API: run one new rollout and answer with its result",
       {200: s.CompatResult, 400: s.ErrorBody, 403: s.ErrorBody, 504: s.ErrorBody,
        429: s.ErrorBody}, body=ProcessRequest,
       tag="reference")
def process():
    """Every call runs a new job, as the reference does: ``job_id`` labels it (``/cancel`` with the
    label reaches every job running under it); the answer's ``job_id`` is the job's own."""
    body: ProcessRequest = parse_body(ProcessRequest)
    if not _state().running():
        raise InvalidRequest("the service is stopped; POST /start first")
    request = JobRequest(instance=body.instance, sampling_params=body.sampling_params, job_id=_run_id(body.job_id))
    check_handlers([request])
    release = acquire_stream()  # before submitting: a refused /process runs nothing
    store, state = _store(), _state()
    try:
        (job_id,) = submit(store, [request], project=caller())
        state.track(job_id, body.job_id)
        status = current_app.extensions["prorl_finishes"].wait(job_id, 2 * _budget_s(body.sampling_params) + 10)
    finally:
        release()
    record = store.get(job_id) if status and status.terminal else None
    if record is None:
        try:
            cancel(store, job_id, reason="/process timed out")
        except JobAlreadyTerminal:
            pass
    state.untrack(job_id, body.job_id)
    if record is not None:
        return jsonify(reference_result(record.result or {}, record, RolloutStore(store.shards)))
    return error_response(504, "timeout", f"job {job_id} did not finish in time and was cancelled",
                          job_id=job_id)


@route(bp, "post", "/cancel", "Reference API: cancel every job running under a job_id",
       {200: s.CompatCancelResponse, 400: s.ErrorBody, 404: s.ErrorBody}, body=CancelRequest, tag="reference")
def cancel_one():
    """Cancel the jobs ``/process`` runs under the label ``job_id``, and the job of that id
    itself (one submitted to ``/jobs``, or one of /process by its own id). Once none is left
    running, the answer says how the last one ended (``cancelled: false``)."""
    body: CancelRequest = parse_body(CancelRequest)
    store = _store()
    live, last = _state().runs(body.job_id)
    records = own(store.get_many([*live, body.job_id]))
    if not records and last is not None:
        records = own(store.get_many([last]))
    if not records:
        raise UnknownJob(body.job_id)
    cancelled = cancel_many(store, records, reason="cancelled by /cancel")
    if cancelled:
        return jsonify({"job_id": body.job_id, "cancelled": True, "status": "cancelled", "job_ids": cancelled})
    latest = max(records, key=lambda r: r.t_created)  # early termination races completion: not an error
    return jsonify({"job_id": body.job_id, "cancelled": False, "status": latest.status.value, "job_ids": []})


def _agent_turns(result: dict[str, Any], rollouts: RolloutStore | None
                 ) -> tuple[list[Turn], list[dict[str, Any]]] | None:
    """The built-in agent's turns (each with its exact prompt ids, rebuilt from the job's
    rollout) and conversation; None for a handler without them."""
    ref = result.get(TRAJECTORY_KEY)
    if not isinstance(ref, dict) or rollouts is None:
        return None
    records, messages = rollouts.snapshot(result["job_id"], int(ref.get("calls", 0)), int(ref.get("messages", 0)))
    return turns_of([Call.unpack(blob) for blob in records]), messages


def _error_text(error: Any) -> str | None:
    if not error:
        return None
    if isinstance(error, dict):
        return f"{error.get('type', 'error')}: {error.get('message', '')}"
    return str(error)


def reference_result(result: dict[str, Any], record: JobRecord | None = None,
                     rollouts: RolloutStore | None = None) -> dict[str, Any]:
    """Our result plus the reference system's field names and message shape; the built-in
    agent's trajectory built from the job's rollout (``rollouts``)."""
    timing = result.get("timing") or {}
    counted = sum(timing.get(k, 0.0) for k in ("init", "run", "eval"))
    agent = _agent_turns(result, rollouts)
    turns, history = agent if agent is not None else (None, None)
    out = dict(expand_result(rollouts.shards, result) if rollouts is not None else result)
    out["messages"] = reference_messages(history if history else result.get("messages") or [], turns)
    out["tools"] = result.get("tools") or (agent_tools.ALL if turns is not None else [])
    out["git_patch"] = result.get("git_patch") or ""
    out["resolved"] = bool(result.get("resolved"))
    out["filter"] = bool(result.get("filter"))
    out["error"] = _error_text(result.get("error"))
    if result.get("error"):
        out["error_info"] = result["error"]
    out.setdefault("finish", result.get("status") == "completed" and result.get("critical_error") is None)
    out.setdefault("success", result.get("status") == "completed")
    out.setdefault("end_properly", out["finish"])
    out["timing"] = {**timing, "init_time": timing.get("init", 0.0), "run_time": timing.get("run", 0.0),
                     "eval_time": timing.get("eval", 0.0),
                     "others_time": max(0.0, timing.get("total", 0.0) - counted - timing.get("queue", 0.0)),
                     "counted_elapsed": counted,
                     "timeout_triggered": result.get("critical_error") == "timeout"}
    return out
