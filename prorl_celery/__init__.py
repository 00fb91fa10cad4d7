"""prorl-celery: rollout-as-a-service for RL training of multi-turn LLM agents.

The Celery app (``prorl_celery.celery_app.app``) is built on first access of ``prorl_celery.app``
(or ``.celery``), which is how ``celery -A prorl_celery`` finds it: importing the package or its
trainer SDK (``prorl_celery.client``) does not import Celery."""
from __future__ import annotations

from typing import Any

__all__ = ["app", "celery"]


def __getattr__(name: str) -> Any:
    if name in ("app", "celery"):
        from prorl_celery.celery_app import app

        return app
    raise AttributeError(f"module 'prorl_celery' has no attribute {name!r}")
