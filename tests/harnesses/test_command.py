"""A team's own harness as a command line, through the whole service: it finds its gateway in the
usual variables, and however it ends (finishes, never calls the model, crashes, loops past its
budget) the job ends with a typed finish reason and its calls as tokens."""
from __future__ import annotations

import os

import pytest
import requests

from prorl_celery import keys
from prorl_celery.fakes.problems import MATH
from tests.conftest import submit, wait, wait_until
from tests.harnesses.test_mini_swe_agent import generated, oracle_llm  # noqa: F401 - the oracle backend fixture

AGENT = r'''
import json, os, sys, urllib.request
url, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
task = open(os.environ["PRORL_TASK_FILE"]).read()
messages = [{"role": "user", "content": task}]
for _ in range(int(sys.argv[1])):
    req = urllib.request.Request(url + "/chat/completions", method="POST",
        data=json.dumps({"model": os.environ["PRORL_MODEL"], "messages": messages}).encode(),
        headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    try:
        answer = json.load(urllib.request.urlopen(req, timeout=30))["choices"][0]["message"]
    except urllib.error.HTTPError as exc:
        print("refused", exc.code, exc.read().decode()); sys.exit(3)
    messages += [answer, {"role": "tool", "tool_call_id": "t", "content": "ok"}]
print("calls done")
'''


def agent_command(calls: int) -> str:
    """The agent above as a command line (it runs in a bwrap sandbox: no file of the test is there)."""
    return f"python3 -I - {calls} <<'PY'\n{AGENT}\nPY"


def _run(api, tmp_path, command: str, **agent) -> dict:
    instance = {"data_source": "math", "problem": MATH[0]["problem"], "answer": MATH[0]["answer"],
                "agent": {"harness": "command", "command": command, **agent}}
    view = wait(api, submit(api, instance), timeout=120)
    assert view["status"] == "completed", view["result"]
    return view["result"]


def test_a_command_harness_calls_its_gateway(api, oracle_llm, tmp_path):
    result = _run(api, tmp_path, agent_command(2))
    assert result["finish_reason"] == "exited" and "calls done" in result["harness"]["output"]
    assert result["turns"] == 2 and result["token_mode"] == "exact"
    assert sum(result["tokens"]["loss_mask"]) == sum(len(m["token_ids"]) for m in generated(result)) > 0
    assert [m["role"] for m in result["messages"]] == ["user", "assistant", "tool", "assistant"]


@pytest.mark.parametrize("command,agent,reason,turns", [
    ("true", {}, "no_llm_calls", 0),
    ("python3 -c 'raise SystemExit(7)'", {}, "harness_error", 0),
    (agent_command(50), {"max_calls": 3}, "max_calls", 3),
])
def test_every_ending_is_typed(api, oracle_llm, tmp_path, command, agent, reason, turns):
    result = _run(api, tmp_path, command, **agent)
    assert result["finish_reason"] == reason and result["turns"] == turns, result["harness"]
    if reason == "max_calls":
        assert "refused 403" in result["harness"]["output"] and "insufficient_quota" in result["harness"]["output"]


def _running(marker: str) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                return True
        except OSError:
            continue
    return False


def test_cancel_kills_the_harness_and_keeps_its_calls(api, redis_client, oracle_llm, tmp_path):
    marker = f"{301 + os.getpid() % 97}.25"
    instance = {"data_source": "math", "problem": MATH[0]["problem"], "answer": MATH[0]["answer"],
                "agent": {"harness": "command", "command": f"{agent_command(1)}\nsleep {marker}"}}
    job = submit(api, instance)
    wait_until(lambda: _running(marker), 60, "the harness to reach its sleep")
    # its one call is on the job's rollout once the run stage saved it (as it completed)
    wait_until(lambda: redis_client.llen(keys.rollout_calls(job)) == 1, 30, "the call to be saved")
    assert requests.delete(f"{api}/jobs/{job}", timeout=10).status_code in (200, 202)
    view = wait(api, job, timeout=60)
    assert view["status"] == "cancelled"
    result = view["result"]
    assert result["error"]["type"] == "cancelled" and result["harness"]["name"] == "command"
    assert result["turns"] == 1 and result["token_mode"] == "exact"  # the partial trajectory
    (answer,) = generated(result)
    assert answer["token_ids"] and result["tokens"]["response_ids"] == answer["token_ids"]
    wait_until(lambda: not _running(marker), 30, "the harness's processes to be gone")


@pytest.mark.parametrize("agent,field", [
    ({"harness": "no_such_harness"}, "instance.agent.harness"),
    ({"harness": "command"}, "instance.agent.command"),
    ({"harness": "mini_swe_agent", "step_limit": 5, "shell": "zsh"}, "instance.agent.shell"),
    ({"harness": "command", "command": "true", "max_calls": 0}, "instance.agent.max_calls"),
])
def test_a_bad_agent_block_is_refused_at_submission(api, agent, field):
    resp = requests.post(f"{api}/jobs", json={"instance": {"data_source": "math", "problem": "1+1?", "answer": "2",
                                                           "agent": agent}}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["field"] == field, resp.json()


GATED = r'''
import json, os, sys, time, urllib.request
url, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
messages = [{"role": "user", "content": open(os.environ["PRORL_TASK_FILE"]).read()}]
for k in range(2):
    if k == 1:  # the test's gate: a file it makes once the trainer has moved on
        for _ in range(1200):
            if os.path.exists(sys.argv[1]):
                break
            time.sleep(0.1)
    req = urllib.request.Request(url + "/chat/completions", method="POST",
        data=json.dumps({"model": os.environ["PRORL_MODEL"], "messages": messages}).encode(),
        headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    messages += [json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["message"],
                 {"role": "tool", "tool_call_id": "t", "content": "ok"}]
print("calls done")
'''


def test_a_stale_call_of_a_harness_is_fenced_as_the_built_in_agents_turns(api, oracle_llm, redis_client, tmp_path):
    """Issue 25's bound for a harness session, through the whole service: k = 1; the harness's
    first call is sampled at g1, the trainer moves to g3 before its second (the harness waits on
    a gate file in the gateway's socket directory, which the sandbox sees), so the session going
    on masks the first call: the result's ``staleness`` says so and its tokens have loss mask 0."""
    from config.settings import get_settings

    names = (keys.weight_versions(), keys.weight_current(), keys.weight_unconsumed())
    redis_client.delete(*names)
    gate = os.path.join(get_settings().gateway_socket_dir, f"gate-{os.getpid()}-{os.urandom(6).hex()}")
    try:
        assert requests.post(f"{api}/llm_servers/resume", json={"weight_version": "g1"}, timeout=10).ok
        instance = {"data_source": "math", "problem": MATH[0]["problem"], "answer": MATH[0]["answer"],
                    "agent": {"harness": "command", "command": f"python3 -I - {gate} <<'PY'\n{GATED}\nPY"}}
        job = submit(api, instance, sampling_params={"max_staleness": 1})
        wait_until(lambda: redis_client.llen(keys.rollout_calls(job)) == 1, 60, "the first call to be saved")
        for version in ("g2", "g3"):
            assert requests.post(f"{api}/llm_servers/resume", json={"weight_version": version}, timeout=10).ok
        open(gate, "w").close()
        view = wait(api, job, timeout=120)
    finally:
        redis_client.delete(*names)
        if os.path.exists(gate):
            os.unlink(gate)
    assert view["status"] == "completed", view["result"]
    result = view["result"]
    assert result["finish_reason"] == "exited" and result["turns"] == 2, result["harness"]
    stats = result["staleness"]
    assert stats["masked_turns"] == [0] and stats["max_lag"] == 2 and stats["max_lag_kept"] == 0
    assert stats["fence"] == "mask" and stats["max_staleness"] == 1
    first, second = generated(result)
    assert [first["weight_version"], second["weight_version"]] == ["g1", "g3"]
    assert first.get("stale_masked") is True and not second.get("stale_masked")
    assert result["token_mode"] == "exact"
    assert sum(result["tokens"]["loss_mask"]) == len(second["token_ids"]) > 0
    assert result["harness"]["counts"]["stale_masked_tokens"] == len(first["token_ids"]) > 0


def test_a_harness_lost_with_its_worker_runs_again_from_the_start(api, stack, oracle_llm, redis_client):
    """The run worker is killed (SIGKILL) while its harness runs, after the harness's first call
    was saved. A harness cannot be resumed mid-session (its process and gateway went with the
    worker), so the redelivered run stage runs it again from the start, in a fresh sandbox, on a
    rollout started over: the result holds the second session's call alone, never the lost one's
    beside it, and says it restarted."""
    import signal

    from config.settings import get_settings
    from prorl_celery.jobs import JobStore

    marker = f"{401 + os.getpid() % 97}.75"
    gate = os.path.join(get_settings().gateway_socket_dir, f"gate-{os.getpid()}-{os.urandom(6).hex()}")
    command = (f'if [ -e ~/touched ]; then echo DIRTY; fi; touch ~/touched\n{agent_command(1)}\n'
               f'[ -e {gate} ] || sleep {marker}')
    instance = {"data_source": "math", "problem": MATH[0]["problem"], "answer": MATH[0]["answer"],
                "agent": {"harness": "command", "command": command}}
    try:
        job = submit(api, instance)
        wait_until(lambda: _running(marker), 60, "the harness to reach its sleep")
        wait_until(lambda: redis_client.llen(keys.rollout_calls(job)) == 1, 30, "its call to be saved")
        first_sandbox = JobStore(redis_client).get(job).sandbox["sandbox_id"]
        open(gate, "w").close()  # the harness run again will not sleep
        old = stack.children["worker-run"]
        old.signal(signal.SIGKILL)
        old.popen.wait()
        view = wait(api, job, timeout=120)  # the stack's supervisor starts a new run worker
    finally:
        if os.path.exists(gate):
            os.unlink(gate)
    result = view["result"]
    assert view["status"] == "completed", result
    assert view["attempts"]["run"] == 2 and result["harness"]["restarts"] == 1, (view["attempts"], result["harness"])
    assert JobStore(redis_client).get(job).sandbox["sandbox_id"] != first_sandbox
    assert "DIRTY" not in result["harness"]["output"] and "calls done" in result["harness"]["output"]
    assert result["turns"] == 1 and [m["role"] for m in result["messages"]] == ["user", "assistant"]
    assert redis_client.llen(keys.rollout_calls(job)) == 1  # the lost session's call is gone from the rollout
    (answer,) = generated(result)
    assert result["tokens"]["response_ids"] == answer["token_ids"] and result["token_mode"] == "exact"
    wait_until(lambda: not _running(marker), 30, "the lost harness's processes to be gone")
