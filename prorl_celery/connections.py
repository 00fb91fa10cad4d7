"""Per-process connections, made on first use from the settings."""
from __future__ import annotations

import functools
import logging

import redis
from celery.signals import worker_init

from config.settings import get_settings
from prorl_celery.jobs import JobStore
from prorl_celery.llm.store import forget_clients
from prorl_celery.shards import Shards, parse_urls

# The client's name and version as given, not looked up per connection (see get_redis); redis-py
# before 7 takes them as lib_version.
_IDENTITY = ({"driver_info": redis.DriverInfo(lib_version=redis.__version__)} if hasattr(redis, "DriverInfo")
             else {"lib_version": redis.__version__})
log = logging.getLogger(__name__)
_cap: int | None = None  # a stage worker's smaller pool (worker_redis_connections), set at its start


@functools.cache
def get_redis() -> redis.Redis:
    """One pool per process. redis-py 8 caps a pool at 100 connections and then *fails* a
    command; the API serves hundreds of requests at once, so a full pool makes a command wait
    for a free connection instead. Its reads time out after 5 s unless told otherwise; blocking
    reads (the completion stream) wait in slices shorter than the 30 s set here. The pool is at
    least as large as the API's threads, so streams blocked on Redis never leave a submission
    waiting for a connection (connections are made only when needed). The library's version
    is given: redis-py otherwise reads its package metadata from disk for every connection it
    makes (``importlib.metadata``), which a burst of a thousand stage threads made by the
    hundred."""
    return _client(get_settings().redis_url)


@functools.cache
def get_shards() -> Shards:
    """The head's Redis and the store shards of ``store_shards`` (:mod:`prorl_celery.shards`)."""
    return Shards(get_redis(), [_client(url) for url in parse_urls(get_settings().store_shards)])


def _client(url: str) -> redis.Redis:
    settings = get_settings()
    size = _cap or max(settings.redis_max_connections, settings.api_threads + settings.api_max_streams + 16)
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=size, timeout=30,
        health_check_interval=25, socket_keepalive=True, socket_timeout=30, socket_connect_timeout=10,
        **_IDENTITY)
    return redis.Redis(connection_pool=pool)


@functools.cache
def get_store() -> JobStore:
    return JobStore(get_redis(), job_ttl_s=get_settings().job_ttl_s, shards=get_shards())


@worker_init.connect
def _worker_pool(**_: object) -> None:
    """A stage worker's threads share a few connections: none of them blocks on Redis (the
    one blocking reader, :mod:`prorl_celery.completions`, holds one), so a full pool only
    makes a thread wait a command's time."""
    global _cap
    _cap = get_settings().worker_redis_connections
    get_store.cache_clear()
    get_shards.cache_clear()
    get_redis.cache_clear()
    forget_clients()
    check_store_layout()


def check_store_layout() -> None:
    """Refuse to start with store shards other than the store's (:meth:`Shards.check_layout`,
    raises :class:`~prorl_celery.errors.StoreLayoutMismatch`); a Redis that does not answer yet
    is not a mismatch (the process's own reconnects deal with it)."""
    try:
        get_shards().check_layout()
    except redis.RedisError as exc:
        log.warning("the store's layout was not checked: %s", exc)
