"""The HTTP API: ``create_app()`` builds it; one blueprint per area."""
from __future__ import annotations

from typing import Any

from flask import Flask

from config.settings import get_settings


def create_app(test_config: dict[str, Any] | None = None) -> Flask:
    from flask_api import audit, compat, errors, groups, health, jobs, limits, llm, metrics, openapi, stream, weights
    from prorl_celery.completions import FinishWatcher
    from prorl_celery.connections import get_store

    app = Flask(__name__)
    settings = get_settings()
    app.config.from_mapping(MAX_CONTENT_LENGTH=64 * 1024 * 1024, API_TOKEN=settings.api_token,
                            WAIT_MAX_S=settings.api_max_wait_s)
    if test_config:
        app.config.from_mapping(test_config)
    app.extensions["prorl_store"] = get_store()
    app.extensions["prorl_finishes"] = FinishWatcher(app.extensions["prorl_store"])
    errors.init_app(app)
    limits.init_app(app)
    health.init_app(app)
    app.register_blueprint(weights.bp)  # before jobs: /jobs/ack is not a job id
    app.register_blueprint(jobs.bp)
    app.register_blueprint(health.bp)
    app.register_blueprint(groups.bp)
    app.register_blueprint(stream.bp)
    app.register_blueprint(compat.bp)
    app.register_blueprint(metrics.bp)
    app.register_blueprint(llm.bp)
    app.register_blueprint(audit.bp)
    app.register_blueprint(openapi.bp)
    return app
