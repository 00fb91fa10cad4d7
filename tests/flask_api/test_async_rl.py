"""Weights change under running multi-turn rollouts, through the whole service: a stack of its own
(real Redis, Celery workers, the API over HTTP, bwrap sandboxes) and a fake LLM server with the
real servers' pause semantics (``--latency-model``: each turn takes seconds, so a pause lands in
the middle of turns). A trainer's step: ``POST /llm_servers/pause``, weights written, ``POST
/llm_servers/resume {"weight_version"}``; the staleness bound (``max_staleness``) with its
admission control and per-turn fence; ``POST /jobs/ack`` as the trainer's "consumed"."""
from __future__ import annotations

import json
import time

import pytest
import requests

from prorl_celery.client import ProrlClient
from tests.conftest import own_stack, wait_until

pytestmark = pytest.mark.timeout(600)
N = 16
FILL = 110  # tokens of text before each tool call (the byte tokenizer: one per character)
SCRIPT = [{"content": "a" * FILL, "tool_calls": [{"name": "bash", "arguments": {"command": "echo one"}}]},
          {"content": "b" * FILL, "tool_calls": [{"name": "bash", "arguments": {"command": "echo two"}}]},
          {"content": "c" * FILL, "tool_calls": [{"name": "submit", "arguments": {"answer": "2"}}]}]
PROBLEM = {"data_source": "math", "problem": "What is 1 + 1?", "answer": "2"}
TOKEN_MODE = {"token_level_generation": True, "max_turns": 5}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    script = tmp_path_factory.mktemp("script") / "turns.json"
    script.write_text(json.dumps(SCRIPT))
    with own_stack(tmp_path_factory.mktemp("async-rl"), persist=False,
                   concurrency={"init": 8, "run": N + 4, "eval": 8, "maint": 1},
                   env={"PRORL_SANDBOX_CAPACITY": str(N + 16), "PRORL_STALENESS_POLL_S": "0.1"}) as stack:
        url = stack.start_fake_llm(name="fake-async-rl", extra_args=[
            "--policy", f"scripted:{script}", "--latency-model", "step_s=0.02,capacity=64"])
        client = ProrlClient(stack.api_url, token=stack.api_token)
        backend = client.add_llm_server(url, protocol="generate", dialect="fake", pause_api="vllm",
                                        weight_version="v1", capacity=64)
        yield stack, client, url, backend["id"]


def _fake(url: str, what: str, **params):
    return requests.get(f"{url}/debug/{what}", params=params, timeout=10).json()


def _running(url: str) -> int:
    return int(_fake(url, "stats")["running"])


def _results(client: ProrlClient, job_ids: list[str]) -> list[dict]:
    views = {v["job_id"]: v for v in client.as_completed(job_ids, timeout=300)}
    return [views[j] for j in job_ids]


def _step(client: ProrlClient, mode: str, version: str) -> dict:
    """The trainer's weight sync: pause until safe, write (here: nothing), resume with the version."""
    paused = client.pause(mode)
    assert paused["safe"] is True, paused
    client.resume(weight_version=version)
    return paused


def _check_versions(view: dict, allowed: set[str]) -> list[list[dict]]:
    """Every generated token has a version among ``allowed``; added ids have none. Returns each
    assistant message's segments."""
    result = view["result"]
    tokens, versions = result["tokens"], result["token_versions"]
    assert result["token_mode"] == "exact" and versions is not None
    assert len(versions) == len(tokens["response_ids"]) == len(tokens["loss_mask"])
    masked = set((result.get("staleness") or {}).get("masked_turns") or [])
    generated = 0
    for k, message in enumerate(m for m in result["messages"] if m["role"] == "assistant"):
        segs = message["weight_segments"]
        assert segs[0]["start"] == 0 and segs[-1]["end"] == len(message["token_ids"])
        generated += len(message["token_ids"]) if k not in masked else 0
    assert all(v is None or v in allowed for v in versions)
    assert sum(tokens["loss_mask"]) == generated  # every trained token is a generated one
    return [m["weight_segments"] for m in result["messages"] if m["role"] == "assistant"]


@pytest.mark.slow  # ~13 s each; the default suite keeps test_weight_sync's pause over HTTP in both modes
@pytest.mark.parametrize("mode,new", [("keep", "v2"), ("abort", "v3")])
def test_sixteen_rollouts_in_flight_lose_no_turn_across_a_weight_update(service, mode, new):
    stack, client, url, bid = service
    old = client.llm_servers()[0]["weight_version"]
    since = max([r["id"] for r in _fake(url, "requests")["requests"]], default=0)
    job_ids = client.submit_many([{"instance": PROBLEM, "sampling_params": TOKEN_MODE} for _ in range(N)])
    wait_until(lambda: _running(url) >= N // 2, 120, "half the rollouts generating at once")
    paused = _step(client, mode, new)
    assert paused["modes"] == {bid: mode} and paused["pause_s"] > 0
    views = _results(client, job_ids)
    assert all(v["status"] == "completed" for v in views), [v["result"].get("error") for v in views]
    assert all(v["result"]["reward"] == 1.0 for v in views)
    spanning = 0
    for view in views:
        segments = _check_versions(view, {old, new})
        assert view["result"]["turns"] == len(SCRIPT)
        spanning += sum(1 for segs in segments if len(segs) > 1)
    assert spanning >= 1  # some turn was cut by the update: its tokens carry both versions
    sent = [r for r in _fake(url, "requests", since=since)["requests"] if r["endpoint"] == "generate"]
    assert not [r for r in sent if r["status"] != "ok"]  # no request dropped: no token thrown away
    cut = [r for r in sent if r["finish_reason"] == "abort"]
    if mode == "keep":  # frozen in place: one request per turn, none restarted
        assert len(sent) == N * len(SCRIPT) and not cut
    else:  # each cut turn went on from its ids: one more request per cut, none from zero
        assert len(cut) >= 1 and len(sent) == N * len(SCRIPT) + len(cut)
        by_prompt = {tuple(r["prompt_ids"]): r for r in sent}
        for r in cut:
            assert tuple(r["prompt_ids"] + r["response_ids"]) in by_prompt  # continued from prompt + partial


def test_staleness_bound_fences_turns_across_three_bumps(service):
    stack, client, url, bid = service
    start = client.llm_servers()[0]["weight_version"]
    job_ids = client.submit_many([{"instance": PROBLEM, "sampling_params": {**TOKEN_MODE, "max_staleness": 1}}
                                  for _ in range(8)])
    wait_until(lambda: client.weights()["unconsumed"] == 8, 120, "all eight admitted")
    for version in ("v4", "v5", "v6"):  # three updates while the batch runs
        time.sleep(1.0)
        _step(client, "keep", version)
    views = _results(client, job_ids)
    assert all(v["status"] == "completed" for v in views), [v["result"].get("error") for v in views]
    masked_somewhere = 0
    for view in views:
        staleness = view["result"]["staleness"]
        assert staleness["max_staleness"] == 1 and staleness["fence"] == "mask"
        assert staleness["max_lag_kept"] <= 1  # nothing kept more than one version behind at the end
        masked_somewhere += len(staleness["masked_turns"])
        _check_versions(view, {start, "v4", "v5", "v6"})
    assert masked_somewhere >= 1
    assert client.ack(job_ids)["unconsumed"] == 0


@pytest.mark.slow  # 23 s: the default suite's time (README: -m slow)
def test_admission_holds_while_the_trainer_runs_ahead_and_releases_when_it_catches_up(service):
    stack, client, url, bid = service
    bounded = {**TOKEN_MODE, "max_staleness": 1}
    first = client.submit(PROBLEM, sampling_params=bounded)
    assert _results(client, [first])[0]["status"] == "completed"  # done, not consumed yet
    _step(client, "keep", "v7")
    _step(client, "keep", "v8")  # the trainer is now two versions ahead of that result
    sent = len(_fake(url, "requests")["requests"])
    held = client.submit(PROBLEM, sampling_params=bounded)
    time.sleep(3.0)
    view = client.get(held)
    assert view["status"] in ("queued", "init", "run"), view  # waiting, not refused
    assert len(_fake(url, "requests")["requests"]) == sent  # and not generating: no turn asked for
    state = client.weights()
    assert state["unconsumed"] == 1 and state["current"] - state["oldest_unconsumed"] == 2
    client.ack([first])  # the trainer consumed it: caught up
    done = _results(client, [held])[0]
    assert done["status"] == "completed"
    assert done["result"]["staleness"]["admission_wait_s"] >= 2.5
    client.ack([held])
