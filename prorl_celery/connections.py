"""Per-process connections, made on first use from the settings."""
from __future__ import annotations

import functools

import redis

from config.settings import get_settings
from prorl_celery.jobs import JobStore


@functools.cache
def get_redis() -> redis.Redis:
    """One pool per process. redis-py 8 caps a pool at 100 connections and then *fails* a
    command; the API serves hundreds of requests at once, so a full pool makes a command wait
    for a free connection instead. Its reads time out after 5 s unless told otherwise; blocking
    reads (the completion stream) wait in slices shorter than the 30 s set here. The pool is at
    least as large as the API's threads, so streams blocked on Redis never leave a submission
    waiting for a connection (connections are made only when needed)."""
    settings = get_settings()
    size = max(settings.redis_max_connections, settings.api_threads + settings.api_max_streams + 16)
    pool = redis.BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=size, timeout=30,
        health_check_interval=25, socket_keepalive=True, socket_timeout=30, socket_connect_timeout=10)
    return redis.Redis(connection_pool=pool)


@functools.cache
def get_store() -> JobStore:
    return JobStore(get_redis(), job_ttl_s=get_settings().job_ttl_s)
