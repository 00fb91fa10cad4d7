"""The sweep's look into a stage queue (tasks/sweep/requeue.py) reads it through kombu's transport:
its length as a passive declare counts it, the ids of the waiting tasks decoded by the
transport's own message class. Real Redis (a database no worker reads), real Celery messages."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from tasks.sweep.requeue import queue_length, task_ids_in


@pytest.fixture
def scratch_app(redis_url) -> Iterator[Celery]:
    url = redis_url.rsplit("/", 1)[0] + "/10"
    redis.Redis.from_url(url).flushdb()
    app = Celery("requeue-test")
    app.config_from_object("config.celeryconfig")
    app.conf.broker_url = url
    yield app
    redis.Redis.from_url(url).flushdb()


@pytest.mark.unit
def test_length_and_ids_of_waiting_messages(scratch_app):
    with scratch_app.connection_for_read() as connection:
        channel = connection.default_channel
        assert queue_length(channel, "run") == 0 and task_ids_in(channel, "run") == set()  # no key yet
        for job in ("j1", "j2"):
            scratch_app.send_task("prorl.run", args=[job], kwargs={"data_source": "shell"},
                                  task_id=f"{job}:run", queue="run", routing_key="run")
        scratch_app.send_task("prorl.eval", args=["j3"], task_id="j3:eval", queue="eval", routing_key="eval")
        assert queue_length(channel, "run") == 2 and queue_length(channel, "eval") == 1
        assert task_ids_in(channel, "run") == {"j1:run", "j2:run"}
        assert task_ids_in(channel, "eval") == {"j3:eval"}
        assert queue_length(channel, "init") == 0


@pytest.mark.unit
def test_an_entry_that_is_no_message_is_skipped(scratch_app):
    with scratch_app.connection_for_read() as connection:
        channel = connection.default_channel
        scratch_app.send_task("prorl.init", args=["j4"], task_id="j4:init", queue="init", routing_key="init")
        channel.client.lpush("init", b"not json", b'{"headers": {}}')
        assert task_ids_in(channel, "init") == {"j4:init"} and queue_length(channel, "init") == 3
