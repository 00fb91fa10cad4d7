"""What a client's job id means on each endpoint: a label on ``/process`` (every call runs a new
rollout, ``/cancel`` reaches every run under it), an idempotency key on ``/jobs`` and ``/groups``
(the same request again gets the same job; another request under a known id is refused, 409)."""
from __future__ import annotations

import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import requests

from prorl_celery import keys
from tests.conftest import wait_until

LOCAL = {"runtime": "local"}
SCRIPT = [{"tool_calls": [{"name": "bash", "arguments": {"command": "echo looked"}}]},
          {"tool_calls": [{"name": "submit", "arguments": {"answer": "7"}}]}]  # two model calls a rollout


def _process(api: str, instance: dict, job_id: str) -> requests.Response:
    return requests.post(f"{api}/process", json={"instance": instance, "sampling_params": {}, "job_id": job_id},
                         timeout=120)


def _calls(url: str) -> list[dict]:
    return [r for r in requests.get(f"{url}/debug/requests", timeout=10).json()["requests"] if r["status"] == "ok"]


def test_process_runs_every_call_under_one_job_id(api, stack, tmp_path):
    """NeMo Gym's prorl_agent sends the instance id as job_id for every sample of a GRPO group and
    again at every step: each call is a rollout of its own (its own model calls, its own id), and
    one with a different instance under a used id answers that instance, never an older result."""
    script = tmp_path / "two.json"
    script.write_text(json.dumps(SCRIPT))
    requests.post(f"{api}/clear_llm_server", timeout=10)
    url = stack.start_fake_llm(name="fake-fresh-rollouts",
                               extra_args=["--policy", f"scripted:{script}", "--latency-model", "none"])
    assert requests.post(f"{api}/llm_servers", json={"address": url, "protocol": "generate", "dialect": "fake"},
                         timeout=10).status_code == 201
    requests.post(f"{url}/debug/reset", timeout=10)  # forget the registration probe
    requests.post(f"{api}/start", timeout=10)
    row, label = {"data_source": "math", "problem": "Look, then answer 7.", "answer": "7"}, f"row-{uuid.uuid4().hex[:6]}"
    try:
        with ThreadPoolExecutor(2) as pool:  # a group of two samples of one row
            group = [f.result() for f in [pool.submit(_process, api, row, label) for _ in range(2)]]
        later = _process(api, row, label)  # the same row at a later step
        other = _process(api, {**row, "problem": "Look, then answer 8.", "answer": "8"}, label)
    finally:
        requests.post(f"{api}/stop", timeout=30)
        requests.post(f"{api}/clear_llm_server", timeout=10)
    answers = [r.json() for r in (*group, later)]
    assert [r.status_code for r in (*group, later, other)] == [200] * 4
    ids = [a["job_id"] for a in answers] + [other.json()["job_id"]]
    assert len(set(ids)) == 4 and all(i.startswith(f"{label}.") for i in ids)
    assert all(a["resolved"] is True for a in answers)
    assert len(_calls(url)) == 4 * len(SCRIPT)  # every rollout asked the model itself
    for answer in answers:
        assert [m["role"] for m in answer["messages"]].count("assistant") == len(SCRIPT)
    assert other.json()["resolved"] is False  # the answer 7 is wrong for this instance ...
    assert "answer 8" in json.dumps(other.json()["messages"])  # ... and it is this instance's rollout


def test_cancel_reaches_every_run_under_a_job_id(api, redis_client, tmp_path):
    requests.post(f"{api}/start", timeout=10)
    label, box = f"many-{uuid.uuid4().hex[:6]}", {}
    instance = {"data_source": "tests.handlers_for_tests:GateHandler", "gate": str(tmp_path / "never")}
    workers = [threading.Thread(target=lambda i=i: box.setdefault(i, _process(api, instance, label)))
               for i in range(2)]
    try:
        for worker in workers:
            worker.start()
        runs = wait_until(lambda: (found := redis_client.smembers(keys.compat_label(label))) and len(found) == 2
                          and sorted(x.decode() for x in found), 30, "both runs")
        cancel = requests.post(f"{api}/cancel", json={"job_id": label}, timeout=10).json()
        assert cancel["cancelled"] is True and sorted(cancel["job_ids"]) == runs
        for worker in workers:
            worker.join(30)
    finally:
        requests.post(f"{api}/stop", timeout=30)
    assert sorted(box[i].json()["job_id"] for i in range(2)) == runs
    assert all(box[i].json()["critical_error"] == "cancelled" for i in range(2))
    again = requests.post(f"{api}/cancel", json={"job_id": label}, timeout=10).json()
    assert again["cancelled"] is False and again["status"] == "cancelled"


def test_a_known_job_id_with_another_request_is_refused(api):
    """POST /jobs: the same request again is a retry (same job, nothing new runs); another instance
    or other sampling parameters under that id get 409 naming job_id, never the old job."""
    job_id = f"known-{uuid.uuid4().hex[:6]}"
    first = {"instance": {"data_source": "shell", "commands": ["echo one"], "sandbox": LOCAL}, "job_id": job_id}
    assert requests.post(f"{api}/jobs", json=first, timeout=10).json() == {"job_ids": [job_id]}
    reordered = {**first, "instance": dict(reversed(list(first["instance"].items())))}
    assert requests.post(f"{api}/jobs", json=reordered, timeout=10).json() == {"job_ids": [job_id]}
    for other in ({**first, "instance": {**first["instance"], "commands": ["echo two"]}},
                  {**first, "sampling_params": {"run_budget_s": 5}},
                  {"jobs": [{**first, "job_id": f"{job_id}-new"}, {**first, "instance": {"data_source": "math"}}]}):
        resp = requests.post(f"{api}/jobs", json=other, timeout=10)
        assert resp.status_code == 409, resp.text
        assert resp.json()["error"]["type"] == "job_id_conflict" and resp.json()["error"]["field"] == "job_id"
    assert requests.get(f"{api}/jobs/{job_id}-new", timeout=10).status_code == 404  # nothing of that batch stored
    view = requests.get(f"{api}/jobs/{job_id}/wait", params={"timeout": 30}, timeout=40).json()
    assert view["result"]["steps"][0]["output"] == "one\n"


def test_a_known_group_with_another_instance_is_refused(api):
    group = f"g-{uuid.uuid4().hex[:6]}"
    body = {"instance": {"data_source": "shell", "commands": ["true"], "sandbox": LOCAL}, "n": 2, "group_id": group}
    assert requests.post(f"{api}/groups", json=body, timeout=10).status_code == 202
    assert requests.post(f"{api}/groups", json=body, timeout=10).json()["job_ids"] == [f"{group}-0", f"{group}-1"]
    changed = {**body, "instance": {**body["instance"], "commands": ["false"]}}
    resp = requests.post(f"{api}/groups", json=changed, timeout=10)
    assert resp.status_code == 409 and resp.json()["error"]["field"] == "job_id"
