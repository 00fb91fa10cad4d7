"""The hack audit's verdicts (``prorl-celery audit`` stores them; tasks/audit/quarantine.py). The
operator's: the verdicts are the fleet's (a quarantine holds for every project) and name every
project's audited tasks, so a project's key gets 403, as for ``/metrics``."""
from __future__ import annotations

from typing import Any

from flask import Blueprint, current_app, jsonify
from pydantic import BaseModel, Field

from config.settings import get_settings
from flask_api.schemas import ErrorBody
from flask_api.routes import route
from flask_api.tenancy import operator_only

bp = Blueprint("audit", __name__)


class AuditVerdict(BaseModel):
    task: str
    data_source: str | None = None
    hackable: bool
    policies: list[str] = Field(default_factory=list, description="The hack policies that earned more than a no-op agent.")
    content_hash: str = Field(description="The hash of what the task's grader reads (files, grading fields).")
    grader_version: str | None = None
    current: bool = Field(description="Whether the verdict is for today's grader version (else it no longer quarantines).")
    baseline: float | None = Field(None, description="The no-op agent's reward.")
    audited_at: float | None = None


class AuditList(BaseModel):
    policy: str = Field(description="What a hackable task's submission gets: refuse, warn or allow (PRORL_AUDIT_POLICY).")
    verdicts: list[AuditVerdict]


@route(bp, "get", "/audit", "The hack audit's verdicts, by task content (the operator's token)",
       {200: AuditList, 403: ErrorBody}, tag="audit")
def list_verdicts():
    from prorl_celery import keys

    operator_only("/audit")
    redis = current_app.extensions["prorl_store"].redis
    items: list[dict[str, Any]] = []
    if redis.exists(keys.audit_verdicts()):
        from tasks.audit import quarantine

        items = quarantine.verdicts(redis)
    return jsonify({"policy": get_settings().audit_policy, "verdicts": items})
