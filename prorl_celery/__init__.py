"""prorl-celery: rollout-as-a-service for RL training of multi-turn LLM agents."""
from prorl_celery.celery_app import app

celery = app
__all__ = ["app", "celery"]
