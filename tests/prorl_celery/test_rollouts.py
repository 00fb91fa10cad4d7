"""The append-only rollout store against a real Redis: records round-trip, prompts are derived,
a stage's save appends inside its fence, and what a rollout writes grows with its trajectory."""
from __future__ import annotations

import random
import uuid

import pytest

from prorl_celery import keys
from prorl_celery.jobs import JobStore
from prorl_celery.llm.models import Protocol, Turn
from prorl_celery.models import JobRequest
from prorl_celery.rollout.store import Call, RolloutStore, common_prefix, is_exact, prompts
from prorl_celery.status import JobStatus, StageState
from prorl_celery.rollout.results import TRAJECTORY_KEY
from prorl_celery.rollout.trajectory import flatten, flatten_calls
from prorl_celery.rollout.views import expand_result
from prorl_celery.rollout.transcript import Transcript, call_of, turns_of

pytestmark = pytest.mark.unit  # in process (tests/unit_tier.py)


@pytest.fixture
def redis_client(scratch_redis):
    """Jobs put in a running stage by hand live where no sweep ends them (tests/unit_tier.py)."""
    return scratch_redis


def _turn(prompt: list[int] | None, response: list[int] | None, k: int = 0) -> Turn:
    return Turn(backend_id="b1", address="http://x", weight_version=f"v{k}", protocol=Protocol.GENERATE,
                model="m", content=f"turn {k}", prompt_ids=prompt, message_count=2 * k + 2,
                response_ids=response, logprobs=None if response is None else [-0.1 * (i + 1) / 3 for i in
                                                                                  range(len(response))])


def _exact_turns(n: int, grow: int = 50) -> list[Turn]:
    """``n`` turns, each prompt the previous prompt and response plus ``grow`` new ids."""
    rng = random.Random(n)
    prompt, out = [rng.randrange(50000) for _ in range(30)], []
    for k in range(n):
        response = [rng.randrange(50000) for _ in range(rng.randrange(1, 20))]
        out.append(_turn(prompt, response, k))
        prompt = prompt + response + [rng.randrange(50000) for _ in range(grow)]
    return out


def test_common_prefix_finds_the_first_difference():
    a = list(range(1000))
    assert common_prefix(a, a + [5]) == 1000 and common_prefix(a, []) == 0
    for cut in (0, 1, 499, 999):
        assert common_prefix(a, a[:cut] + [-1] + a[cut + 1:]) == cut


def test_a_record_round_trips_exactly():
    turns = _exact_turns(3)
    call = call_of(turns[1], turns[0])
    back = Call.unpack(call.pack())
    assert back == call and back.keep == len(turns[0].prompt_ids) + len(turns[0].response_ids)
    assert back.logprobs == turns[1].logprobs  # float64: bit for bit
    assert len(back.new_ids) == 50
    none = Call.unpack(call_of(_turn(None, None), None).pack())
    assert none.new_ids is None and none.response_ids is None and none.logprobs is None


def test_full_prompts_are_derived_and_the_trajectory_matches_the_turns():
    turns = _exact_turns(6)
    calls = [call_of(t, p) for t, p in zip(turns, [None, *turns[:-1]])]
    assert list(prompts(calls)) == [t.prompt_ids for t in turns] and is_exact(calls)
    assert flatten_calls(calls) == flatten(turns)
    assert turns_of(calls) == turns


def test_a_re_rendered_history_keeps_its_common_prefix_and_flattens_as_before():
    turns = _exact_turns(3)
    first = turns[0]
    changed = first.prompt_ids + [7, 7] + turns[2].prompt_ids[len(first.prompt_ids) + 2:]
    turns[2] = turns[2].model_copy(update={"prompt_ids": changed})
    calls = [call_of(t, p) for t, p in zip(turns, [None, *turns[:-1]])]
    assert not is_exact(calls) and calls[2].keep < len(turns[1].prompt_ids)
    assert list(prompts(calls)) == [t.prompt_ids for t in turns]
    assert flatten_calls(calls) == flatten(turns) and flatten_calls(calls)[1] == "retokenized"


def test_the_store_appends_reads_the_last_and_rebuilds_any_prompt(redis_client):
    store, rid = RolloutStore(redis_client, ttl_s=60), uuid.uuid4().hex
    turns = _exact_turns(5)
    calls = [call_of(t, p) for t, p in zip(turns, [None, *turns[:-1]])]
    assert store.append(rid, calls[:2], [{"role": "user", "content": "hi"}]) == 2
    assert store.append(rid, calls[2:]) == 5
    assert store.read(rid) == calls and store.read(rid, 2) == calls[:2] and store.last(rid) == calls[-1]
    assert [store.prompt(rid, k) for k in range(5)] == [t.prompt_ids for t in turns]
    assert store.messages(rid) == [{"role": "user", "content": "hi"}]
    assert 0 < redis_client.ttl(keys.rollout_calls(rid)) <= 60
    with pytest.raises(IndexError):
        store.prompt(rid, 5)


@pytest.fixture
def jobs(redis_client):
    return JobStore(redis_client, job_ttl_s=60)


def _running(jobs: JobStore, stage: JobStatus = JobStatus.RUN) -> str:
    job_id = uuid.uuid4().hex
    jobs.create_many([(job_id, JobRequest(instance={"data_source": "math"}))])
    for step in (JobStatus.INIT, JobStatus.RUN):
        assert jobs.transition(job_id, step, stage_state=StageState.RUNNING)[0]
    return job_id


def _save(jobs: JobStore, job_id: str, transcript: Transcript, attempt: int = 1) -> bool:
    calls, messages = transcript.pending()
    state = {"_rollout": transcript.counts()}
    ok = jobs.save_state(job_id, JobStatus.RUN, attempt, state, transcript.saved_counts(), calls, messages)
    if ok:
        transcript.mark_saved()
    return ok


def test_a_save_appends_in_its_fence_and_a_stray_write_is_trimmed(jobs, redis_client):
    job_id = _running(jobs)
    turns = _exact_turns(4)
    transcript = Transcript()
    transcript.messages.append({"role": "system", "content": "s"})
    transcript.add(turns[0])
    assert _save(jobs, job_id, transcript)
    # a delivery that lost the job appended past the saved counts before its own save failed
    redis_client.rpush(keys.rollout_calls(job_id), call_of(turns[3], None).pack())
    for turn in turns[1:3]:
        transcript.add(turn)
        transcript.messages.append(turn.message)
    assert _save(jobs, job_id, transcript)
    assert jobs.get(job_id).state["_rollout"] == {"calls": 3, "messages": 3}
    resumed = Transcript.load(RolloutStore(redis_client), job_id, {"calls": 3, "messages": 3})
    assert resumed.last == turns[2] and resumed.turns() == turns[:3] and resumed.messages == transcript.messages
    assert redis_client.llen(keys.rollout_calls(job_id)) == 3
    transcript.add(turns[3])
    assert not _save(jobs, job_id, transcript, attempt=2)  # another attempt's delivery: nothing written
    assert jobs.transition(job_id, JobStatus.CANCELLED)[0]
    assert not _save(jobs, job_id, transcript)  # an ended job: nothing written
    assert redis_client.llen(keys.rollout_calls(job_id)) == 3
    assert 0 < redis_client.ttl(keys.rollout_calls(job_id)) <= 60  # expires with the finished job


def test_a_new_attempt_starts_an_empty_rollout(jobs, redis_client):
    job_id = _running(jobs)
    first = Transcript()
    first.messages.append({"role": "user", "content": "a"})
    first.add(_exact_turns(1)[0])
    assert _save(jobs, job_id, first)
    again = Transcript()  # state {} of the next attempt: counts 0
    again.messages.append({"role": "user", "content": "b"})
    assert _save(jobs, job_id, again)
    assert redis_client.llen(keys.rollout_calls(job_id)) == 0
    assert RolloutStore(redis_client).messages(job_id) == [{"role": "user", "content": "b"}]


def test_the_result_references_the_rollout_and_reads_build_the_trajectory(jobs, redis_client):
    job_id = _running(jobs)
    turns = _exact_turns(3)
    transcript = Transcript()
    transcript.messages.append({"role": "user", "content": "go"})
    for k, turn in enumerate(turns):
        transcript.answer(turn)  # stored tagged as call k's answer
        if k == 0:  # a message no call generated, in the middle: it takes no call's ids
            transcript.messages.append({"role": "assistant", "content": "written, not generated"})
    assert _save(jobs, job_id, transcript)
    stored = {"job_id": job_id, "status": "completed", TRAJECTORY_KEY: {"calls": 3, "messages": 5}}
    out = expand_result(redis_client, stored)
    tokens, mode = flatten(turns)
    assert out["tokens"] == tokens and out["token_mode"] == mode == "exact" and TRAJECTORY_KEY not in out
    assistant = [m for m in out["messages"] if m["role"] == "assistant"]
    ids = [turns[0].response_ids, None, *(t.response_ids for t in turns[1:])]
    assert [m.get("token_ids") for m in assistant] == ids
    assert [m.get("weight_version") for m in assistant] == ["v0", None, "v1", "v2"]
    assert [m.get("call") for m in assistant] == [0, None, 1, 2]


def test_bytes_stored_grow_with_the_trajectory_not_its_square(jobs, redis_client):
    """40 turns of a prompt that grows by ~400 ids: every save together writes about the final
    trajectory once, where whole-prompt turns would write turns x context."""
    job_id = _running(jobs)
    turns = _exact_turns(40, grow=400)
    transcript, written = Transcript(), 0
    for turn in turns:
        transcript.add(turn)
        calls, _ = transcript.pending()
        written += sum(map(len, calls))
        assert _save(jobs, job_id, transcript)
    final = len(flatten(turns)[0]["prompt_ids"]) + len(flatten(turns)[0]["response_ids"])
    whole = sum(len(t.prompt_ids) for t in turns)
    assert final > 15000 and whole > 15 * final
    assert written < 8 * final  # 4 bytes an id, 12 a generated one (id and logprob), some metadata
    assert redis_client.memory_usage(keys.rollout_calls(job_id)) < 10 * final


def test_a_save_onto_a_shorter_list_appends_once(jobs, redis_client):
    """A list shorter than its saved count (its entries lost) is appended to, once: the save tells
    a stray write from the append's reply, and only a longer list is trimmed."""
    job_id = _running(jobs)
    turns = _exact_turns(3)
    transcript = Transcript()
    transcript.add(turns[0])
    assert _save(jobs, job_id, transcript)
    redis_client.delete(keys.rollout_calls(job_id))
    for turn in turns[1:]:
        transcript.add(turn)
    assert _save(jobs, job_id, transcript)
    assert redis_client.llen(keys.rollout_calls(job_id)) == 2
