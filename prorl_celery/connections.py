"""Per-process connections, made on first use from the settings."""
from __future__ import annotations

import functools

import redis

from config.settings import get_settings
from prorl_celery.jobs import JobStore


@functools.cache
def get_redis() -> redis.Redis:
    # redis-py 8 reads with a 5 s socket timeout unless told otherwise; blocking reads (the
    # completion stream) wait in slices shorter than this.
    return redis.Redis.from_url(get_settings().redis_url, health_check_interval=25,
                                socket_keepalive=True, socket_timeout=30, socket_connect_timeout=10)


@functools.cache
def get_store() -> JobStore:
    return JobStore(get_redis(), job_ttl_s=get_settings().job_ttl_s)
