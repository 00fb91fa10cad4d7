"""The connections a worker process makes: its job-store pool and Celery's result backend."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def _in_fresh_process(code: str) -> str:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()


def test_a_stage_worker_keeps_a_small_pool_and_the_api_a_large_one():
    out = _in_fresh_process("""
        from celery.signals import worker_init
        from config.settings import get_settings
        from prorl_celery import celery_app  # what `celery -A prorl_celery worker` imports
        from prorl_celery.connections import get_redis
        before = get_redis().connection_pool.max_connections
        worker_init.send(sender=None)  # as Celery does when a worker starts
        after = get_redis().connection_pool.max_connections
        print(before, after, get_settings().worker_redis_connections)
    """)
    before, after, setting = map(int, out.split())
    assert after == setting < before  # a worker: the setting; any other process: api threads + streams


def test_a_workers_threads_share_one_result_backend():
    out = _in_fresh_process("""
        import threading
        from prorl_celery.celery_app import app
        seen = [id(app.backend)]  # the worker's main thread makes it first
        threads = [threading.Thread(target=lambda: seen.append(id(app.backend))) for _ in range(4)]
        for t in threads: t.start()
        for t in threads: t.join()
        print(len(set(seen)), app.backend.max_connections)
    """)
    backends, cap = map(int, out.split())
    assert backends == 1 and cap >= 1024  # one pool, above the thousand threads of a run worker


@pytest.mark.unit
def test_connections_name_the_client_without_reading_package_metadata(monkeypatch):
    import importlib.metadata

    from prorl_celery import connections

    connections.get_redis.cache_clear()
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: (_ for _ in ()).throw(AssertionError(f"metadata of {name} read")))
    try:
        pool = connections.get_redis().connection_pool
        assert pool.make_connection().driver_info.lib_version
    finally:
        connections.get_redis.cache_clear()
