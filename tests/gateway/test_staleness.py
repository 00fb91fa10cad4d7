"""The staleness bound (issue 25) for a harness session behind its gateway, as for the built-in
agent: over real HTTP (the ``openai`` client driving the calls as a harness does), the LLM pool
and the fake LLM, with the trainer's weight updates made the real way (``resume`` with a new
``weight_version``: the backend's version and the current one for the bound) between and during
calls. ``mask``: a call more than k versions behind when the session goes on (or ends) keeps its
ids with loss mask 0, counted in the result's ``staleness``; ``regenerate``: a call whose answer
came back stale is generated again on the current weights before the harness sees it."""
from __future__ import annotations

import importlib.util
import json
import secrets

import pytest

from prorl_celery import keys
from prorl_celery.gateway import CallLog, Gateway, GatewaySession
from prorl_celery.jobstate import ROLLOUT_KEY
from prorl_celery.llm.control import resume
from prorl_celery.rollout.results import TRAJECTORY_KEY, harness_result_fields
from prorl_celery.rollout.segments import harness_fields
from prorl_celery.rollout.store import RolloutStore
from prorl_celery.rollout.views import expand_result
from prorl_celery.staleness import WeightVersions
from tasks.agent.fence import StalenessFence
from tests.gateway.test_openai_chat import _client, stored
from tests.llm.conftest import TOOLS, add

if importlib.util.find_spec("openai") is None:
    pytest.skip("the 'openai' package is not installed", allow_module_level=True)
SCRIPT = [{"content": "", "tool_calls": [{"name": "bash", "arguments": {"cmd": c}}]} for c in ("ls", "pwd", "id")]
SCRIPT.append({"content": "Done."})


@pytest.fixture
def versions(redis_conn):
    """The service's weight versions, emptied before and after (the bound's keys are global)."""
    names = (keys.weight_versions(), keys.weight_current(), keys.weight_unconsumed())
    redis_conn.delete(*names)
    yield WeightVersions(redis_conn)
    redis_conn.delete(*names)


def _setup(fake_llms, pool, tmp_path, policy: str, k: int, versions, generate=None):
    path = tmp_path / "script.json"
    path.write_text(json.dumps(SCRIPT))
    (proc,) = fake_llms(1, policy=f"scripted:{path}")
    add(pool, proc, protocol="generate")
    resume(pool.registry, None, "s1")  # the trainer's first version: the backend serves it, it is current
    sid = f"gw-stale-{secrets.token_hex(4)}"
    session = GatewaySession(sid, generate or (lambda req, stop: pool.generate(sid, req, should_stop=stop)),
                             CallLog.to_store(RolloutStore(pool.redis), sid), fence=StalenessFence(versions, k, policy))
    return proc, Gateway(session, token=secrets.token_urlsafe(16))


def _call(client, messages: list) -> dict:
    message = client.chat.completions.create(model="m", messages=messages, tools=TOOLS) \
        .choices[0].message.model_dump(exclude_none=True)
    messages.append(message)
    for call in message.get("tool_calls") or []:
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": "out"})
    return message


def _result(gw: Gateway) -> dict:
    """The job's result as the run stage and the API build it from the session (as run_harness,
    which saves the log's last calls first: the writer thread may not have yet)."""
    gw.session.log.flush()
    block = {"name": "command", "session": gw.session.session_id, "staleness": gw.session.fence_all()}
    calls = gw.session.log.transcript.counts()
    result = harness_result_fields({"harness": block, ROLLOUT_KEY: calls})
    result["job_id"] = gw.session.session_id
    result[TRAJECTORY_KEY] = calls
    return result


def test_mask_fences_calls_more_than_k_versions_behind(fake_llms, pool, redis_conn, tmp_path, versions):
    proc, gw = _setup(fake_llms, pool, tmp_path, "mask", 1, versions)
    with gw:
        client, messages = _client(gw), [{"role": "user", "content": "go"}]
        _call(client, messages)  # call 0 at s1
        _call(client, messages)  # call 1 at s1
        resume(pool.registry, None, "s2")
        _call(client, messages)  # call 2 at s2 (calls 0 and 1 lag 1: kept)
        assert gw.session.staleness()["masked_turns"] == []
        resume(pool.registry, None, "s3")
        resume(pool.registry, None, "s4")
        last = _call(client, messages)  # the session goes on at s4: calls 0-2 lag 3, 3, 2 > 1
        assert gw.session.staleness()["masked_turns"] == [0, 1, 2]
        result = _result(gw)
    records, _ = stored(gw, redis_conn)
    assert last["content"] == "Done." and [r.meta["weight_version"] for r in records] == ["s1", "s1", "s2", "s4"]
    stats = result["staleness"]
    assert stats["masked_turns"] == [0, 1, 2] and stats["max_lag"] == 3 and stats["max_lag_kept"] == 0
    assert stats["fence"] == "mask" and stats["max_staleness"] == 1 and stats["regenerated_turns"] == 0
    # the trainer's view: the fenced calls' ids are there with loss mask 0, counted apart
    view = harness_fields(records, stats["masked_turns"])
    (segment,) = view["segments"]
    stale = sum(len(r.response_ids) for r in records[:3])
    assert view["counts"]["stale_masked_tokens"] == stale > 0
    assert sum(segment["loss_mask"]) == len(records[3].response_ids)
    expanded = expand_result(redis_conn, result)
    assert expanded["token_mode"] == "exact" and sum(expanded["tokens"]["loss_mask"]) == len(records[3].response_ids)
    marks = [m.get("stale_masked", False) for m in expanded["messages"] if m["role"] == "assistant"]
    assert marks == [True, True, True, False]
    assert len(proc.received()) == 4  # masking regenerates nothing


def test_regenerate_samples_a_stale_answer_again_before_the_harness_sees_it(fake_llms, pool, redis_conn,
                                                                           tmp_path, versions):
    samples: list = []

    def generate(req, stop):  # the trainer moves two versions while call 1's first sample is in flight
        turn = pool.generate(gw.session.session_id, req, should_stop=stop)
        samples.append(turn)
        if len(samples) == 2:
            resume(pool.registry, None, "s2")
            resume(pool.registry, None, "s3")
        return turn

    proc, gw = _setup(fake_llms, pool, tmp_path, "regenerate", 1, versions, generate)
    with gw:
        client, messages = _client(gw), [{"role": "user", "content": "go"}]
        _call(client, messages)  # call 0 at s1
        second = _call(client, messages)  # call 1: sampled at s1, stale (lag 2) on return: again at s3
        _call(client, messages)  # call 2 at s3: call 0 (s1) is now 2 behind: masked
        result = _result(gw)
    records, _ = stored(gw, redis_conn)
    assert [s.weight_version for s in samples] == ["s1", "s1", "s3", "s3"]
    assert [r.meta["weight_version"] for r in records] == ["s1", "s3", "s3"]
    assert records[1].response_ids == samples[2].response_ids  # the fresh sample is the one recorded
    served = [r for r in proc.received() if r["status"] == "ok"]
    assert len(served) == 4 and [r.response_ids for r in records] == [served[i]["response_ids"] for i in (0, 2, 3)]
    assert json.loads(second["tool_calls"][0]["function"]["arguments"]) == {"cmd": "pwd"}
    stats = result["staleness"]
    assert stats["regenerated_turns"] == 1 and stats["regenerated_tokens"] == len(samples[1].response_ids) > 0
    assert stats["masked_turns"] == [0] and stats["fence"] == "regenerate"


def test_without_a_bound_nothing_is_fenced(fake_llms, pool, redis_conn, tmp_path, versions):
    proc, gw = _setup(fake_llms, pool, tmp_path, "mask", 1, versions)
    gw.session.fence = None
    with gw:
        client, messages = _client(gw), [{"role": "user", "content": "go"}]
        _call(client, messages)
        resume(pool.registry, None, "s5")
        _call(client, messages)
        assert gw.session.staleness() is None and gw.session.fence_all() is None
        result = _result(gw)
    assert "staleness" not in result
    assert sum(expand_result(redis_conn, result)["tokens"]["loss_mask"]) == sum(
        len(r.response_ids) for r in stored(gw, redis_conn)[0])
