"""Jobs: submit (one or a batch), read, wait for, cancel."""
from __future__ import annotations

from flask import Blueprint, current_app, jsonify, request

from flask_api import schemas as s
from flask_api.errors import json_body, parse_body
from flask_api.limits import acquire_stream
from flask_api.routes import WAIT_SECONDS, route
from flask_api.tenancy import caller, check_job, owned_record
from prorl_celery.errors import InvalidRequest, UnknownJob, UnknownPlugin
from prorl_celery.jobs import JobStore
from prorl_celery.models import BatchRequest, JobRequest, JobView
from prorl_celery.rollout.views import job_views
from prorl_celery.staleness import check_max_staleness
from tasks.chain import cancel, submit
from tasks.handlers import instance_check

bp = Blueprint("jobs", __name__)
_JOB = {200: JobView, 404: s.ErrorBody}


def _store() -> JobStore:
    return current_app.extensions["prorl_store"]


def _view(job_id: str) -> dict:
    record = owned_record(_store(), job_id)
    return job_views(_store().shards, [record])[0].model_dump(mode="json")


def check_handlers(requests: list[JobRequest], batch: bool = False) -> list[dict]:
    """Refuse, before anything is stored, a job whose data source names no handler, whose
    instance its handler refuses (the operator's policy on runtime, image, repository source;
    a malformed field), or whose ``max_staleness`` would widen the operator's bound. A built-in
    handler is checked without importing it (:func:`tasks.handlers.instance_check`). ``batch``:
    a refusal names the job's place in the batch (``jobs.3.sampling_params...``). Then the hack
    audit's quarantine (:func:`check_quarantine`): returns its warnings."""
    for i, req in enumerate(requests):
        check_max_staleness(req.sampling_params, f"jobs.{i}.sampling_params.max_staleness" if batch
                            else "sampling_params.max_staleness")
    checks = {}
    for source in {req.instance["data_source"] for req in requests}:
        try:
            checks[source] = instance_check(source)
        except UnknownPlugin as exc:
            raise InvalidRequest(str(exc), field="instance.data_source") from None
    for req in requests:
        checks[req.instance["data_source"]](req.instance)
    return check_quarantine(requests)


def check_quarantine(requests: list[JobRequest]) -> list[dict]:
    """A task the hack audit found hackable is refused (409 ``task_quarantined``), accepted with a
    warning, or allowed, per ``PRORL_AUDIT_POLICY`` (:mod:`tasks.audit.quarantine`, imported only
    once some verdict is stored)."""
    from config.settings import get_settings
    from prorl_celery import keys

    redis = _store().redis
    if not redis.exists(keys.audit_verdicts()):
        return []
    from tasks.audit import quarantine

    return quarantine.check(redis, [req.instance for req in requests], get_settings().audit_policy)


@route(bp, "post", "/jobs", "Submit one job or a batch",
       {202: s.SubmitResponse, 400: s.ErrorBody, 403: s.ErrorBody, 409: s.ErrorBody,
        429: s.ErrorBody}, body=[JobRequest, BatchRequest])
def submit_jobs():
    body = json_body()
    model = BatchRequest if isinstance(body, dict) and "jobs" in body else JobRequest
    parsed = parse_body(model)
    requests = parsed.jobs if isinstance(parsed, BatchRequest) else [parsed]
    ids = [req.job_id for req in requests if req.job_id]
    if len(ids) != len(set(ids)):
        raise InvalidRequest("job ids within one batch must be distinct", field="jobs")
    warnings = check_handlers(requests, batch=isinstance(parsed, BatchRequest))
    return jsonify({"job_ids": submit(_store(), requests, project=caller()),
                    **({"warnings": warnings} if warnings else {})}), 202


@route(bp, "get", "/jobs/{job_id}", "A job's status, timings and result", _JOB)
def get_job(job_id: str):
    return jsonify(_view(job_id))


@route(bp, "get", "/jobs/{job_id}/wait", "Wait for a job to end (202 if still running)",
       {**_JOB, 202: JobView, 400: s.ErrorBody}, query={"timeout": WAIT_SECONDS})
def wait_job(job_id: str):
    try:
        timeout = float(request.args.get("timeout", "30"))
    except ValueError:
        raise InvalidRequest("timeout must be a number of seconds", field="timeout") from None
    if not 0 <= timeout <= current_app.config["WAIT_MAX_S"]:
        raise InvalidRequest(f"timeout must be within 0..{current_app.config['WAIT_MAX_S']}",
                             field="timeout")
    release = acquire_stream() if timeout > 0 else (lambda: None)  # a long poll holds a thread
    try:
        check_job(_store(), job_id)  # after the cap: another project's id answers as an unknown one
        status = current_app.extensions["prorl_finishes"].wait(job_id, timeout)
    finally:
        release()
    if status is None:
        raise UnknownJob(job_id)
    return jsonify(_view(job_id)), 200 if status.terminal else 202


@route(bp, "delete", "/jobs/{job_id}", "Cancel a job", {**_JOB, 409: s.ErrorBody})
def cancel_job(job_id: str):
    check_job(_store(), job_id)
    record = cancel(_store(), job_id)
    return jsonify(job_views(_store().shards, [record])[0].model_dump(mode="json"))
