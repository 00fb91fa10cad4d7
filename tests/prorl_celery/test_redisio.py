"""prorl_celery/redisio.py on the session's Redis: a script by digest, whole once Redis lacks it."""
from __future__ import annotations

import uuid

import pytest

from prorl_celery.redisio import LuaScript, missing, text

pytestmark = pytest.mark.unit

INCR_BY = LuaScript("return redis.call('INCRBY', KEYS[1], ARGV[1])")


def test_text_decodes_bytes_and_leaves_the_rest():
    assert text(b"caf\xc3\xa9") == "café" and text("x") == "x" and text(None) is None


def test_a_call_runs_by_digest_and_again_after_redis_lost_its_scripts(redis_client):
    key = f"test:redisio:{uuid.uuid4().hex}"
    redis_client.script_flush()
    assert INCR_BY(redis_client, [key], [2]) == 2  # sent whole: Redis did not have it
    assert redis_client.script_exists(INCR_BY.sha) == [True]  # and now has it
    assert INCR_BY(redis_client, [key], [3]) == 5
    redis_client.script_flush()
    assert INCR_BY(redis_client, [key], [1]) == 6


def test_a_queued_digest_that_redis_lacks_is_told_and_sent_whole(redis_client):
    key = f"test:redisio:{uuid.uuid4().hex}"
    redis_client.script_flush()
    pipe = redis_client.pipeline(transaction=False)
    INCR_BY.queue(pipe, [key], [4])
    pipe.incr(key)
    first, after = pipe.execute(raise_on_error=False)
    assert missing(first) and after == 1  # nothing ran for the script; the rest of the pipeline did
    pipe = redis_client.pipeline(transaction=False)
    INCR_BY.whole(pipe, [key], [4])
    INCR_BY.queue(pipe, [key], [10])  # known once the whole one ran ahead of it
    assert pipe.execute() == [5, 15]
    assert not missing(15) and not missing(ValueError("other"))


@pytest.mark.parametrize("source", ["return 1", "return redis.call('PING')"])
def test_the_digest_is_redis_own(redis_client, source):
    assert LuaScript(source).sha == redis_client.script_load(source)
