"""``GET /metrics``: Prometheus text format."""
from __future__ import annotations

from flask import Blueprint, Response, current_app
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from flask_api.routes import route
from flask_api.schemas import ErrorBody
from flask_api.tenancy import operator_only
from prorl_celery.metrics import ServiceCollector

bp = Blueprint("metrics", __name__)


@route(bp, "get", "/metrics", "Prometheus metrics (the operator's token)", {200: None, 403: ErrorBody},
       tag="operations")
def metrics():
    operator_only("/metrics")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(current_app.extensions["prorl_store"]))
    return Response(generate_latest(registry), mimetype=CONTENT_TYPE_LATEST)
