"""The asynchronous TRL glue without TRL (prorl_celery/integrations/trl.py): ``AsyncRolloutFunc``
returns at each step the batch submitted at the step before and submits the next before
returning, every job under ``max_staleness``, every batch acknowledged once read; ``WeightSync``
pauses the backend in keep mode and resumes it as ``step<N+1>``. A stack of its own and a fake
LLM with vLLM's pause API play the service and the model; the trainer is a stand-in holding
TRL's two fields the glue reads (``args.num_generations``, ``state.global_step``)."""
from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import pytest

from prorl_celery.client import ProrlClient
from prorl_celery.integrations.trl import WeightSync, make_async_rollout_func
from tests.conftest import own_stack

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    script = tmp_path_factory.mktemp("script") / "turns.json"
    script.write_text(json.dumps([{"content": "It is 10001."}]))
    with own_stack(tmp_path_factory.mktemp("async-trl"), persist=False,
                   concurrency={"init": 8, "run": 12, "eval": 8, "maint": 1},
                   env={"PRORL_STALENESS_POLL_S": "0.1"}) as stack:
        url = stack.start_fake_llm(name="fake-async-trl", extra_args=[
            "--policy", f"scripted:{script}", "--latency-model", "step_s=0.01,capacity=64"])
        client = ProrlClient(stack.api_url, token=stack.api_token)
        backend = client.add_llm_server(url, protocol="generate", dialect="fake", pause_api="vllm",
                                        weight_version="step0", capacity=64)
        yield client, backend["id"]


def test_one_batch_ahead_acknowledged_and_versioned(service):
    client, bid = service
    numbers = itertools.count(10000)
    drawn: list[list[int]] = []

    def draw(k: int) -> list[int]:
        drawn.append([next(numbers) for _ in range(k)])
        return drawn[-1]

    rollout = make_async_rollout_func(client, lambda x: {"data_source": "echo", "text": str(x), "match": "contains"},
                                      draw, max_staleness=1, sampling_params={"max_turns": 1, "max_tokens": 16},
                                      backend_ids=[bid])
    sync = WeightSync(client, [bid])
    trainer = SimpleNamespace(args=SimpleNamespace(num_generations=2), state=SimpleNamespace(global_step=0))

    first = rollout(["ignored"] * 4, trainer)  # batch 0 submitted and read; batch 1 submitted
    assert len(drawn) == 2 and len(first["prompt_ids"]) == 4
    assert first["prorl_reward"] == [0.0, 0.0, 1.0, 1.0]  # groups 10000 and 10001, in order
    ahead = rollout.pending["job_ids"]
    assert len(ahead) == 4 and set(ahead).isdisjoint(first["prorl_job_id"])
    assert rollout.sampling_params["max_staleness"] == 1
    assert client.weights()["unconsumed"] <= 4  # batch 0 acknowledged; only batch 1 may hold admission

    sync.before_step(0)  # the optimizer step
    assert sync._answer["modes"] == {bid: "keep"}
    assert sync.after_step(0) == "step1"
    trainer.state.global_step = 1
    second = rollout(["ignored"] * 4, trainer)
    assert second["prorl_job_id"] == ahead  # trained one step later than it was submitted
    versions = {v for vs in second["prorl_token_versions"] for v in vs if v}
    assert versions <= {"step0", "step1"} and versions
    for traj in rollout.history[-1]["trajectories"]:  # admitted under the bound
        assert traj.staleness is not None and "admitted_version" in traj.staleness, traj.staleness
    lags = rollout.history[-1]["lags"]
    assert lags["max"] <= 1 and lags["tokens"] == sum(sum(m) for m in second["env_mask"])
    assert sync.pauses[0]["version"] == "step1" and sync.pauses[0]["frozen_s"] >= 0

    rollout.close()
    assert rollout.pending is None and client.weights()["unconsumed"] == 0
