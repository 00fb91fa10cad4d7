"""The reference system's endpoints, driven the way its trainers drive them."""
from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.conftest import wait_until

LOCAL = {"runtime": "local"}


def _process(api: str, instance: dict, **extra) -> requests.Response:
    return requests.post(f"{api}/process", json={"instance": instance, "sampling_params": {}, **extra},
                         timeout=120)


def _runs(redis_client, label: str) -> list[str]:
    """The jobs /process runs under the label ``label`` (each call runs one of its own)."""
    from prorl_celery import keys

    return sorted(x.decode() for x in redis_client.smembers(keys.compat_label(label)))


def test_trainer_call_sequence(api, stack, redis_client):
    """A reference trainer's step: clear and add the LLM servers, start, many concurrent /process
    calls with trajectory ids, an early /cancel, stop."""
    from prorl_celery.fakes.problems import MATH

    oracle = stack.start_fake_llm(name="fake-compat", extra_args=["--policy", "oracle:prorl_celery.fakes.oracle:reply"])
    assert requests.post(f"{api}/clear_llm_server", timeout=10).status_code == 200
    assert requests.post(f"{api}/add_llm_server", json={"address": oracle}, timeout=10).status_code == 200
    assert requests.post(f"{api}/start", timeout=10).status_code == 200
    try:
        assert requests.post(f"{api}/start", timeout=10).status_code == 400  # already running
        instance = {"data_source": "math", "problem": MATH[1]["problem"], "answer": "5050", "instance_id": "inst-7"}
        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(_process, api, {**instance, "trajectory_id": i}) for i in range(16)]
            results = [f.result().json() for f in futures]
        assert sorted(r["trajectory_id"] for r in results) == list(range(16))
        for r in results:
            assert r["instance_id"] == "inst-7" and r["critical_error"] is None
            assert r["resolved"] is True and r["reward"] == 1.0 and r["finish"] is True
            assert {"init_time", "run_time", "eval_time", "counted_elapsed", "timeout_triggered"} <= set(r["timing"])
            assert [m["role"] for m in r["messages"]][:3] == ["system", "user", "assistant"]
            assert r["git_patch"] == "" and r["filter"] is False and len(r["tokens"]["response_ids"]) > 0

        job_id = f"early-{uuid.uuid4().hex[:6]}"
        box: dict = {}
        worker = threading.Thread(target=lambda: box.setdefault(
            "resp", _process(api, {"data_source": "shell", "sandbox": LOCAL, "commands": ["sleep 30"]},
                             job_id=job_id)))
        worker.start()
        (run,) = wait_until(lambda: _runs(redis_client, job_id), 10, "the job")
        assert run.startswith(f"{job_id}.")  # its own id, labelled
        status = requests.get(f"{api}/status", timeout=10).json()
        assert status["status"] == "running" and status["jobs"] >= 1
        cancel = requests.post(f"{api}/cancel", json={"job_id": job_id}, timeout=10).json()
        assert cancel == {"job_id": job_id, "cancelled": True, "status": "cancelled", "job_ids": [run]}
        worker.join(30)
        answer = box["resp"].json()
        assert answer["critical_error"] == "cancelled" and answer["resolved"] is False and answer["job_id"] == run
        again = requests.post(f"{api}/cancel", json={"job_id": job_id}, timeout=10).json()
        assert again["cancelled"] is False and again["status"] == "cancelled"
        assert requests.post(f"{api}/cancel", json={"job_id": "never-was"}, timeout=10).status_code == 404
    finally:
        stopped = requests.post(f"{api}/stop", timeout=30)
        requests.post(f"{api}/clear_llm_server", timeout=10)
    assert stopped.json()["status"] == "stopped"
    assert requests.get(f"{api}/status", timeout=10).json()["status"] == "stopped"
    refused = _process(api, {"data_source": "shell", "commands": ["true"]})
    assert refused.status_code == 400


def test_stop_cancels_in_flight_process_calls(api, redis_client):
    requests.post(f"{api}/start", timeout=10)
    job_id = f"stopme-{uuid.uuid4().hex[:6]}"
    box: dict = {}
    worker = threading.Thread(target=lambda: box.setdefault("resp", _process(
        api, {"data_source": "shell", "sandbox": LOCAL, "commands": ["sleep 30"]}, job_id=job_id)))
    worker.start()
    (run,) = wait_until(lambda: _runs(redis_client, job_id), 20, "the job")
    wait_until(lambda: requests.get(f"{api}/jobs/{run}", timeout=5).json().get("status") == "run", 20, "run")
    assert requests.post(f"{api}/stop", timeout=30).json()["cancelled"] == 1
    worker.join(30)
    assert box["resp"].json()["status"] == "cancelled"


@pytest.mark.slow  # 12 s: the default suite's time (README: -m slow)
def test_process_times_out_with_504_and_cancels(api):
    requests.post(f"{api}/start", timeout=10)
    try:
        job_id = f"slow-{uuid.uuid4().hex[:6]}"
        # timeout 1 s -> the answer comes after 2 * 1 + 10 s at the latest; the stage budget is longer
        resp = _process(api, {"data_source": "tests.handlers_for_tests:StuckRunHandler", "sandbox": LOCAL},
                        job_id=job_id, sampling_params={"timeout": 1})
        run = resp.json()["error"]["job_id"]
        assert resp.status_code == 504 and run.startswith(f"{job_id}.")
        assert requests.get(f"{api}/jobs/{run}", timeout=10).json()["status"] == "cancelled"
    finally:
        requests.post(f"{api}/stop", timeout=30)


def test_more_concurrent_process_calls_than_a_small_server_would_hold(api, redis_client, tmp_path):
    """150 /process calls wait at once (a reference trainer holds one per rollout): every job is
    submitted while all of them still wait, and all answer once the gate opens."""
    from prorl_celery import keys

    requests.post(f"{api}/start", timeout=10)
    gate, prefix = tmp_path / "gate", f"gate-{uuid.uuid4().hex[:6]}"
    ids = [f"{prefix}-{i}" for i in range(150)]
    instance = {"data_source": "tests.handlers_for_tests:GateHandler", "gate": str(gate)}
    try:
        with ThreadPoolExecutor(len(ids)) as pool:
            futures = [pool.submit(_process, api, {**instance, "trajectory_id": i}, job_id=job_id)
                       for i, job_id in enumerate(ids)]

            def submitted() -> bool:
                pipe = redis_client.pipeline(transaction=False)
                for job_id in ids:
                    pipe.scard(keys.compat_label(job_id))
                return all(pipe.execute())

            wait_until(submitted, 60, "every /process call to have submitted its job")
            assert not any(f.done() for f in futures)
            gate.touch()
            answers = [f.result() for f in futures]
    finally:
        gate.touch()
        requests.post(f"{api}/stop", timeout=60)
    assert [a.status_code for a in answers] == [200] * len(ids)
    assert sorted(a.json()["trajectory_id"] for a in answers) == list(range(len(ids)))
    assert all(a.json()["status"] == "completed" for a in answers)


def test_process_token_mode_messages_carry_each_turns_prompt_ids(api, stack, tmp_path):
    """Token mode through /process: every assistant message has the exact prompt ids the fake
    server was sent (``input_ids``), its response ids and logprobs, and flat tool calls; each
    prompt extends all earlier prompt and response ids (NeMo RL's check on what NeMo Gym passes on)."""
    import json

    turns = [{"tool_calls": [{"name": "bash", "arguments": {"command": f"echo step {i}"}}]} for i in range(2)]
    script = tmp_path / "three.json"
    script.write_text(json.dumps(turns + [{"tool_calls": [{"name": "submit", "arguments": {"answer": "7"}}]}]))
    requests.post(f"{api}/clear_llm_server", timeout=10)
    url = stack.start_fake_llm(name="fake-compat-tokens",
                               extra_args=["--policy", f"scripted:{script}", "--latency-model", "none"])
    assert requests.post(f"{api}/llm_servers", json={"address": url, "protocol": "generate", "dialect": "fake"},
                         timeout=10).status_code == 201
    requests.post(f"{url}/debug/reset", timeout=10)  # forget the registration probe
    requests.post(f"{api}/start", timeout=10)
    try:
        resp = requests.post(f"{api}/process", json={
            "instance": {"data_source": "math", "problem": "Three steps, then answer 7.", "answer": "7"},
            "sampling_params": {"token_level_generation": True}}, timeout=120)
    finally:
        requests.post(f"{api}/stop", timeout=30)
        requests.post(f"{api}/clear_llm_server", timeout=10)
    result = resp.json()
    assert resp.status_code == 200 and result["resolved"] is True and result["token_mode"] == "exact"
    seen = [r for r in requests.get(f"{url}/debug/requests", timeout=10).json()["requests"] if r["status"] == "ok"]
    assistant = [m for m in result["messages"] if m["role"] == "assistant"]
    assert len(assistant) == len(seen) == 3
    context: list[int] = []
    for message, request in zip(assistant, seen):
        assert message["input_ids"] == request["prompt_ids"] and message["token_ids"] == request["response_ids"]
        assert len(message["logprobs"]) == len(message["token_ids"])
        assert message["input_ids"][: len(context)] == context
        context = message["input_ids"] + message["token_ids"]
    assert [c["name"] for m in assistant for c in m["tool_calls"]] == ["bash", "bash", "submit"]
    assert all("function" not in c for m in assistant for c in m["tool_calls"])
    assert all("tool_call_id" not in m for m in result["messages"] if m["role"] == "tool")
    assert result["error"] is None and isinstance(result["success"], bool) and result["tools"]
