"""Gold in, reward out, through the whole service: API, chain, sandbox host, the built-in agent
against the fake LLM (its oracle plays the project's own tasks), and each domain's verifier."""
from __future__ import annotations

import json

import pytest
import requests

from prorl_celery.fakes import swe
from prorl_celery.fakes.problems import MATH, STEM
from tests.conftest import submit, wait, wait_until

ORACLE = ["--policy", "oracle:prorl_celery.fakes.oracle:reply", "--latency-model", "none"]


@pytest.fixture(scope="module")
def llm(stack, api):
    """One chat and one generate backend, both played by the oracle; nothing else registered."""
    requests.post(f"{api}/clear_llm_server", timeout=10)
    chat = stack.start_fake_llm(name="fake-oracle-chat", extra_args=ORACLE)
    gen = stack.start_fake_llm(name="fake-oracle-gen", extra_args=ORACLE)
    for address, protocol in ((chat, "chat"), (gen, "generate")):
        resp = requests.post(f"{api}/llm_servers", json={"address": address, "protocol": protocol,
                                                           **({"dialect": "fake"} if protocol == "generate" else {})}, timeout=10)
        assert resp.status_code == 201, resp.text
    yield {"chat": chat, "generate": gen}
    requests.post(f"{api}/clear_llm_server", timeout=10)


def _run(api: str, instance: dict, timeout: float = 120, **params) -> dict:
    job_id = submit(api, instance, sampling_params=params)
    view = wait(api, job_id, timeout=timeout)
    assert view["status"] == "completed", view["result"]
    return view["result"]


@pytest.mark.parametrize("answer", ["3/2", "1.5", "\\frac{3}{2}", "\\dfrac{6}{4}"])
def test_math_equivalent_forms_score_one(api, llm, answer):
    task = MATH[0]
    result = _run(api, {"data_source": "math", "problem": task["problem"], "answer": answer})
    assert result["reward"] == 1.0 and result["resolved"] is True
    assert result["finish_reason"] == "submit" and result["turns"] == 2  # a bash check, then submit
    assert [m["role"] for m in result["messages"]][:3] == ["system", "user", "assistant"]


def test_math_wrong_answer_scores_zero(api, llm):
    task = MATH[1]
    result = _run(api, {"data_source": "gsm8k", "problem": task["problem"], "answer": "5051"})
    assert result["reward"] == 0.0 and result["resolved"] is False
    assert {k: result["eval"][k] for k in ("given", "expected", "correct", "check")} == {
        "given": "5050", "expected": "5051", "correct": False, "check": "different"}


def test_stem_choice_and_short_answer(api, llm):
    choice = _run(api, {"data_source": "stem", **STEM[0]})
    assert choice["reward"] == 1.0 and choice["eval"]["given"] == "B"
    short = _run(api, {"data_source": "stem", **STEM[1]})
    assert short["reward"] == 1.0


@pytest.mark.parametrize("task_id", ["HumanEval/0", "HumanEval/12", "HumanEval/32", "HumanEval/38"])
def test_humaneval_canonical_solution_scores_one(api, llm, task_id):
    result = _run(api, {"data_source": "humaneval", "task_id": task_id})
    assert result["reward"] == 1.0 and result["resolved"] is True, result["eval"]
    assert result["eval"]["total"] >= 1


@pytest.mark.slow
def test_all_164_humaneval_canonical_solutions(api, llm):
    from tasks.handlers.code import humaneval_problems

    ids = list(humaneval_problems())
    resp = requests.post(f"{api}/jobs", json={"jobs": [
        {"instance": {"data_source": "humaneval", "task_id": t}} for t in ids]}, timeout=60)
    views = [wait(api, job_id, timeout=600) for job_id in resp.json()["job_ids"]]
    failed = [(v["result"]["instance_id"], v["result"].get("eval")) for v in views if v["result"]["reward"] != 1.0]
    assert failed == []


@pytest.mark.parametrize("name", swe.names())
def test_swe_fixture_gold_patch_resolves(api, llm, tmp_path_factory, name):
    instance = swe.build(name, tmp_path_factory.mktemp("swe"))
    result = _run(api, instance, timeout=180)
    assert result["resolved"] is True and result["reward"] == 1.0, result["eval"]
    assert result["eval"]["FAIL_TO_PASS"] == {t: "PASSED" for t in instance["FAIL_TO_PASS"]}
    changed = {line[6:] for line in result["git_patch"].splitlines() if line.startswith("+++ b/")}
    assert changed == {line[6:] for line in instance["patch"].splitlines() if line.startswith("+++ b/")}


def _scripted(stack, api, tmp_path, turns: list, name: str) -> str:
    script = tmp_path / f"{name}.json"
    script.write_text(json.dumps(turns))
    requests.post(f"{api}/clear_llm_server", timeout=10)
    url = stack.start_fake_llm(name=name, extra_args=["--policy", f"scripted:{script}", "--latency-model", "none"])
    assert requests.post(f"{api}/llm_servers", json={"address": url, "protocol": "generate", "dialect": "fake"}, timeout=10).ok
    return url


@pytest.fixture
def restore_oracle(api, llm):
    yield
    requests.post(f"{api}/clear_llm_server", timeout=10)
    for protocol, address in llm.items():
        requests.post(f"{api}/llm_servers", json={"address": address, "protocol": protocol,
                                                           **({"dialect": "fake"} if protocol == "generate" else {})}, timeout=10)


def test_swe_empty_and_wrong_patches_do_not_resolve(api, stack, tmp_path, restore_oracle):
    instance = swe.build("statkit", tmp_path / "repos")
    _scripted(stack, api, tmp_path, [{"tool_calls": [{"name": "submit", "arguments": {}}]}], "fake-submit-now")
    empty = _run(api, instance)
    assert empty["resolved"] is False and empty["reward"] == 0.0 and empty["eval"] == {"skipped": "empty patch"}
    wrong_edit = "sed -i 's/return ordered\\[len(ordered) \\/\\/ 2\\]/return ordered[0]/' statkit/central.py"
    _scripted(stack, api, tmp_path, [{"tool_calls": [{"name": "bash", "arguments": {"command": wrong_edit}}]},
                                     {"tool_calls": [{"name": "submit", "arguments": {}}]}], "fake-wrong")
    wrong = _run(api, instance)
    assert "statkit/central.py" in wrong["git_patch"]
    assert wrong["resolved"] is False and wrong["reward"] == 0.0
    assert "FAILED" in wrong["eval"]["PASS_TO_PASS"].values()  # the wrong fix broke a passing test


def test_humaneval_wrong_solution_scores_below_one(api, stack, tmp_path, restore_oracle):
    wrong = "def separate_paren_groups(paren_string):\n    return []\n"
    _scripted(stack, api, tmp_path, [{"tool_calls": [{"name": "submit", "arguments": {"answer": wrong}}]}],
              "fake-wrong-code")
    result = _run(api, {"data_source": "humaneval", "task_id": "HumanEval/1"})
    assert result["reward"] < 1.0 and result["resolved"] is False


def test_token_mode_trajectory_is_exact(api, stack, tmp_path, restore_oracle):
    """5 turns in token mode: the flattened tokens equal, id for id, what the fake server generated
    plus the tokenised observations between turns, with the loss mask on the generated ids only."""
    bash = [{"tool_calls": [{"name": "bash", "arguments": {"command": f"echo step {i}"}}]} for i in range(4)]
    url = _scripted(stack, api, tmp_path, bash + [{"tool_calls": [{"name": "submit", "arguments": {"answer": "7"}}]}],
                    "fake-five-turns")
    requests.post(f"{url}/debug/reset", timeout=10)
    result = _run(api, {"data_source": "math", "problem": "Five steps, then answer 7.", "answer": "7"},
                  token_level_generation=True)
    assert result["turns"] == 5 and result["token_mode"] == "exact" and result["reward"] == 1.0
    seen = [r for r in requests.get(f"{url}/debug/requests", timeout=10).json()["requests"] if r["status"] == "ok"]
    assert len(seen) == 5
    tokens = result["tokens"]
    assert tokens["prompt_ids"] == seen[0]["prompt_ids"]
    assert tokens["prompt_ids"] + tokens["response_ids"] == seen[-1]["prompt_ids"] + seen[-1]["response_ids"]
    expected_mask, position = [], len(seen[0]["prompt_ids"])
    for k, request in enumerate(seen):
        if k:
            added = len(request["prompt_ids"]) - position
            assert request["prompt_ids"][:position] == (tokens["prompt_ids"] + tokens["response_ids"])[:position]
            expected_mask += [0] * added
        expected_mask += [1] * len(request["response_ids"])
        position = len(request["prompt_ids"]) + len(request["response_ids"])
    assert tokens["loss_mask"] == expected_mask
    assert len(tokens["logprobs"]) == len(tokens["response_ids"])
    assert all(lp == 0.0 for lp, m in zip(tokens["logprobs"], tokens["loss_mask"]) if m == 0)
    assert all(lp < 0.0 for lp, m in zip(tokens["logprobs"], tokens["loss_mask"]) if m == 1)
    observations = [m["content"] for m in result["messages"] if m["role"] == "tool"]
    assert observations[:4] == [f"step {i}\n" for i in range(4)]
    assert all(m.get("backend_id") for m in result["messages"] if m["role"] == "assistant")
    cost = result["cost"]  # what the server saw, per backend: every prompt whole, every generated id
    ((backend, spent),) = cost["llm"].items()
    assert backend == result["messages"][2]["backend_id"] and spent["calls"] == cost["llm_calls"] == 5
    assert spent["prompt_tokens"] == cost["prompt_tokens"] == sum(len(r["prompt_ids"]) for r in seen)
    assert spent["generated_tokens"] == cost["generated_tokens"] == sum(len(r["response_ids"]) for r in seen)
    assert 0 < cost["llm_s"] <= result["timing"]["run"] and cost["wall_s"]["run"] == result["timing"]["run"]


def test_user_handler_by_dotted_path(api):
    result = _run(api, {"data_source": "tests.handlers_for_tests:UserHandler", "x": 21})
    assert result["doubled"] == 42 and result["reward"] == 0.25


# burns a second of CPU holding 100 MiB, then prints its own rusage: CPU-seconds, max RSS (KiB)
BURN = ("python3 -c 'import json, resource, time\n"
        "b = b\"x\" * (100 << 20)\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 1.0: pass\n"
        "r = resource.getrusage(resource.RUSAGE_SELF)\n"
        "print(json.dumps([r.ru_utime + r.ru_stime, r.ru_maxrss, len(b)]))'")


def test_cost_has_what_the_sandboxs_cgroup_counted(api, redis_client):
    """cost.sandbox: the host's reading of the sandbox's cgroup at its close, against what the
    burning process itself counted (its rusage); the operator's totals take it in."""
    from prorl_celery.rollout.cost import OPERATOR, totals
    from sandboxes.runtimes.limits.cgroups import accounting

    if accounting() is None:
        pytest.skip("no cgroup v1 cpuacct here (or not root): sandboxes are not measured")
    before = totals(redis_client).get(OPERATOR, {}).get("sandbox_cpu_s", 0.0)
    result = _run(api, {"data_source": "shell", "commands": [BURN], "sandbox": {"runtime": "bwrap"}})
    own_cpu, own_rss_kb, held = json.loads(result["steps"][0]["output"])
    spent = result["cost"]["sandbox"]
    assert spent["source"] == "cgroup" and spent["sandboxes"] == 1 and held == 100 << 20
    assert own_cpu <= spent["cpu_s"] <= own_cpu + 0.75, (own_cpu, spent)  # + bash, python's start
    # the 100 MiB it held, at least; its RSS also counts shared library pages charged elsewhere
    assert 100 <= spent["peak_memory_mb"] <= own_rss_kb / 1024 + 64, (own_rss_kb, spent)
    # the totals are added just after the result is stored (tasks/outcome.py): a waiter may come first
    after = wait_until(lambda: (t := totals(redis_client)[OPERATOR])["sandbox_cpu_s"] - before >= spent["cpu_s"] - 1e-6
                       and t, 10, "the operator's totals to take the job's sandbox CPU in")
    assert after["sandbox_peak_memory_mb"] >= spent["peak_memory_mb"]


def test_a_local_sandbox_is_not_measured(api):
    result = _run(api, {"data_source": "shell", "commands": ["echo hi"], "sandbox": {"runtime": "local"}})
    assert result["sandbox"]["runtime"] == "local" and result["cost"]["sandbox"] is None
