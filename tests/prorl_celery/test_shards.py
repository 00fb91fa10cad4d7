"""The rollout store on two Redis of its own (prorl_celery/shards.py), in process: jobs land on
both shards, never on the head; a running stage's saves write the shard alone, fenced there by
attempt and stage; every reader (the record, the transcript, the result's views, the cost reader)
finds each rollout and its running stage's state on its shard."""
from __future__ import annotations

import json

import pytest
import redis

from prorl_celery import keys
from prorl_celery.jobs import JobStore
from prorl_celery.jobstate import ROLLOUT_KEY
from prorl_celery.ops.launcher import Stack, StackOptions
from prorl_celery.rollout.cost import read_heads
from prorl_celery.rollout.store import RolloutStore
from prorl_celery.rollout.trajectory import flatten
from prorl_celery.rollout.views import expand_results
from prorl_celery.shards import ShardLostWrites, Shards, parse_urls
from prorl_celery.status import JobStatus, StageState
from tasks.context import StageContext
from tasks.handlers.math import MathHandler
from tests.prorl_celery.test_rollouts import _exact_turns
from tests.tasks.test_context_rollout import _in_run

# Not the unit tier: it starts two Redis of its own (the unit tier allows only the session's).


@pytest.fixture(scope="module")
def shard_clients(tmp_path_factory):
    stack = Stack(StackOptions(state_dir=tmp_path_factory.mktemp("shards"), persist=False))
    try:
        urls = stack.start_store_shards(2)
        yield [redis.Redis.from_url(url) for url in urls]
    finally:
        stack.stop()


@pytest.fixture
def store(scratch_redis, shard_clients):
    for client in shard_clients:
        client.flushdb()
    return JobStore(scratch_redis, job_ttl_s=60, shards=Shards(scratch_redis, shard_clients))


def _run_two_turns(store: JobStore, job_id: str) -> None:
    ctx = StageContext(store, store.get(job_id), JobStatus.RUN, budget_s=60.0)
    ctx.transcript.messages.append({"role": "user", "content": f"go {job_id}"})
    for turn in _exact_turns(2):
        ctx.transcript.add(turn)
        ctx.transcript.messages.append(turn.message)
        ctx.save()


def test_rollouts_land_on_both_shards_and_every_reader_finds_them(store, scratch_redis, shard_clients):
    jobs = [_in_run(store) for _ in range(12)]
    for job_id in jobs:
        _run_two_turns(store, job_id)
    held = [{j for j in jobs if client.exists(keys.rollout_calls(j))} for client in shard_clients]
    assert held[0] and held[1] and not held[0] & held[1] and held[0] | held[1] == set(jobs)
    assert all(store.shards.store_for(j) is shard_clients[store.shards.index(j)] for j in jobs)
    assert not any(scratch_redis.exists(keys.rollout_calls(j), keys.rollout_messages(j)) for j in jobs)
    assert all(store.get(j).state[ROLLOUT_KEY] == {"calls": 2, "messages": 3} for j in jobs)  # the shard's state
    assert not any(scratch_redis.hget(keys.job(j), "state") for j in jobs)  # the head was not written per turn
    assert [r.state[ROLLOUT_KEY]["calls"] for r in store.get_many(jobs)] == [2] * len(jobs)

    rollouts = RolloutStore(store.shards)
    assert all(len(rollouts.read(j)) == 2 and rollouts.messages(j)[0]["content"] == f"go {j}" for j in jobs)
    results = [{"job_id": j, **MathHandler().result_fields(store.get(j).state)} for j in jobs]
    for j, out in zip(jobs, expand_results(store.shards, results)):  # one pipeline per shard
        assert out["turns"] == 2 and out["messages"][0]["content"] == f"go {j}"
        assert (out["tokens"], out["token_mode"]) == flatten(_exact_turns(2))
    assert [len(h) for h in read_heads(store.shards, [(j, 2) for j in jobs])] == [2] * len(jobs)
    again = StageContext(store, store.get(jobs[0]), JobStatus.RUN, budget_s=60.0)  # a redelivery resumes
    assert len(again.transcript.turns()) == 2


def test_the_fence_holds_on_the_shard(store, scratch_redis):
    job_id = _in_run(store)
    shard = store.shards.store_for(job_id)
    # attempt 2 saves on the shard: a late write of attempt 1 is refused there, before any trim
    assert store.shards.save(job_id, "run", 2, "{}", {}, [b"a2"], [], 60)
    assert not store.save_state(job_id, JobStatus.RUN, 1, {"x": 1}, {}, [b"a1"], [])
    assert shard.lrange(keys.rollout_calls(job_id), 0, -1) == [b"a2"]
    scratch_redis.hset(keys.job(job_id), "attempt", 2)
    assert store.save_state(job_id, JobStatus.RUN, 2, {"n": 1}, {}, [b"c1"], ["{}"])
    assert store.get(job_id).state == {"n": 1}  # the shard's, while run runs in attempt 2
    # the stage ends: the head takes the state it ended with, and the next stage's reader sees it
    assert store.transition(job_id, None, stage_state=StageState.DONE, state={"n": 1, "done": True})[0]
    assert store.get(job_id).state == {"n": 1, "done": True}
    assert store.transition(job_id, JobStatus.EVAL, stage_state=StageState.RUNNING)[0]
    assert store.get(job_id).state == {"n": 1, "done": True}  # the shard's is run's, not eval's
    assert store.save_state(job_id, JobStatus.EVAL, 2, {"n": 2}, {"calls": 1, "messages": 1}, [b"e1"], [])
    # a late run delivery of the same attempt is behind eval now: refused, nothing trimmed
    assert not store.save_state(job_id, JobStatus.RUN, 2, {"n": 9}, {"calls": 0, "messages": 0}, [b"late"], [])
    assert shard.lrange(keys.rollout_calls(job_id), 0, -1) == [b"c1", b"e1"]
    assert store.get(job_id).state == {"n": 2}
    # a stray write past the counts (a delivery that lost the job) is trimmed by the next save
    shard.rpush(keys.rollout_calls(job_id), b"stray")
    assert store.save_state(job_id, JobStatus.EVAL, 2, {"n": 3}, {"calls": 2, "messages": 1}, [b"e2"], [])
    assert shard.lrange(keys.rollout_calls(job_id), 0, -1) == [b"c1", b"e1", b"e2"]
    assert all(0 < shard.ttl(k(job_id)) for k in (keys.rollout_calls, keys.rollout_fence, keys.rollout_state))
    # a retry from init (attempt 3) does not read attempt 2's state
    assert store.transition(job_id, JobStatus.QUEUED, stage_state=StageState.NONE, state={}, attempt=3)[0]
    assert store.transition(job_id, JobStatus.INIT, stage_state=StageState.RUNNING)[0]
    assert store.transition(job_id, JobStatus.RUN, stage_state=StageState.RUNNING)[0]
    assert store.get(job_id).state == {}


def test_a_cancel_mid_stage_keeps_the_turns_the_shard_holds_and_the_stage_notices(store, scratch_redis):
    """The save does not read the head: a cancel's result takes the counts from the shard, the
    head keeps the final state, and the stage learns of the cancel through the watch."""
    from prorl_celery.errors import JobCancelled
    from tasks.outcome import finish

    job_id = _in_run(store)
    ctx = StageContext(store, store.get(job_id), JobStatus.RUN, budget_s=60.0)
    ctx.transcript.messages.append({"role": "user", "content": "go"})
    for turn in _exact_turns(2):
        ctx.transcript.answer(turn)
        ctx.save()
    ctx.check()  # still running
    result = finish(store, store.get(job_id), JobStatus.CANCELLED)
    assert result is not None and result.cost["llm_calls"] == 2
    assert json.loads(scratch_redis.hget(keys.job(job_id), "state"))[ROLLOUT_KEY] == {"calls": 2, "messages": 3}
    with pytest.raises(JobCancelled):
        for _ in range(100):  # the watch's reading is at most MAX_AGE_S old
            ctx.check()
            import time
            time.sleep(0.02)
    assert store.get(job_id).state[ROLLOUT_KEY] == {"calls": 2, "messages": 3}  # the head's, now final


def test_unsharded_is_the_head_alone_and_the_setting_parses(scratch_redis):
    shards = Shards.of(scratch_redis)
    assert not shards.sharded and shards.store_for("any") is scratch_redis
    assert JobStore(scratch_redis).shards.store_for("x") is scratch_redis
    assert parse_urls(" redis://a:1/0, ,redis://b:2/0 ") == ["redis://a:1/0", "redis://b:2/0"]
    assert parse_urls("") == [] and parse_urls(None) == []


def test_a_process_with_another_layout_is_refused(scratch_redis, shard_clients):
    from prorl_celery.errors import StoreLayoutMismatch

    scratch_redis.delete(keys.store_layout())
    for client in shard_clients:
        client.flushdb()
    Shards(scratch_redis, shard_clients).check_layout()  # the first one sets it
    Shards(scratch_redis, shard_clients).check_layout()  # the same: fine
    with pytest.raises(StoreLayoutMismatch, match="keep the list's order"):
        Shards(scratch_redis, shard_clients[::-1]).check_layout()
    with pytest.raises(StoreLayoutMismatch, match="names 0 store shards"):
        Shards(scratch_redis).check_layout()  # a worker started without PRORL_STORE_SHARDS
    with pytest.raises(StoreLayoutMismatch, match="names 1 store shards"):
        Shards(scratch_redis, shard_clients[:1]).check_layout()



def _lists(shard, job_id: str) -> tuple[list[bytes], list]:
    return (shard.lrange(keys.rollout_calls(job_id), 0, -1),
            [json.loads(m) for m in shard.lrange(keys.rollout_messages(job_id), 0, -1)])


def test_a_save_sends_again_what_a_shard_lost(store):
    """A shard runs with appendfsync everysec: a crash may lose its last appends. The next save
    finds a list shorter than its saved count and sends the missing tail from the writer's
    transcript (which holds every turn, those it loaded tags and all), so the lists end complete
    and in order; a writer with nothing to send it from stops as on any loss of the store (a Redis
    error: the stage is resumed)."""
    job_id = _in_run(store)
    shard = store.shards.store_for(job_id)
    turns = _exact_turns(4)
    writer = StageContext(store, store.get(job_id), JobStatus.RUN, budget_s=60.0)
    writer.transcript.messages.append({"role": "user", "content": "go"})
    for turn in turns[:2]:
        writer.transcript.answer(turn)
        writer.save()
    calls, messages = _lists(shard, job_id)
    assert len(calls) == 2 and len(messages) == 3 and messages[2]["call"] == 1  # the answers tagged

    # the second turn's appends lost behind the writer's back (its transcript still counts them)
    shard.rpop(keys.rollout_calls(job_id))
    shard.rpop(keys.rollout_messages(job_id))
    with pytest.raises(ShardLostWrites):  # nothing to send them from: refused, nothing written
        store.save_state(job_id, JobStatus.RUN, 1, {}, {"calls": 2, "messages": 3}, [b"x"], ["{}"])
    assert _lists(shard, job_id) == (calls[:1], messages[:2])
    writer.transcript.answer(turns[2])
    writer.save()  # the lost turn is sent again, then the new one
    third = _lists(shard, job_id)
    assert third[0][:2] == calls and third[1][:3] == messages and len(third[0]) == 3 and len(third[1]) == 4
    assert store.get(job_id).state[ROLLOUT_KEY] == {"calls": 3, "messages": 4}

    # a redelivery's transcript (loaded from the shard) after the shard lost both lists whole
    again = StageContext(store, store.get(job_id), JobStatus.RUN, budget_s=60.0)
    assert len(again.transcript.turns()) == 3
    shard.delete(keys.rollout_calls(job_id), keys.rollout_messages(job_id))
    again.transcript.answer(turns[3])
    again.save()
    fourth = _lists(shard, job_id)
    assert fourth[0][:3] == third[0] and fourth[1][:4] == third[1] and len(fourth[0]) == 4
    assert len(RolloutStore(store.shards).read(job_id)) == 4
    assert [t.response_ids for t in again.transcript.turns()] == [t.response_ids for t in turns]
