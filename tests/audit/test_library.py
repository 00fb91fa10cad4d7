"""The hack policy library, the task sets and the verdicts, in process (the policies' own attacks
run in sandboxes: test_audit_e2e.py)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from prorl_celery.errors import InvalidRequest
from tasks.audit import policies, taskset
from tasks.audit.verdict import Evidence, evidence, judge

unit = pytest.mark.unit  # all but the bash syntax check, which starts bash
ROOT = Path(__file__).resolve().parents[2]
CLASSES = ["reward or verifier-log files", "shadowing the tests", "conftest", "sitecustomize", "PATH shims",
           "log parser counts as a pass", "exit-code", "reading tests/ or solution/", "git history",
           "network", "outlives the agent", "resource exhaustion", "test runner's modules", "runner's imports"]


@unit
def test_the_library_covers_every_class_of_the_issue_one_file_each():
    lib = policies.library()
    for cls in CLASSES:
        assert [p.name for p in lib.values() if cls in p.hack_class], cls
    assert len({p.hack_class for p in lib.values()}) == len(lib) >= len(CLASSES)
    for policy in lib.values():
        assert (policies.HERE / f"{policy.name}.sh").is_file()
        assert len(policy.script) <= policies.COMMAND_MAX, policy.name  # fits the command harness


def test_each_policy_is_valid_bash_and_writes_no_fixed_names():
    for policy in policies.library().values():
        check = subprocess.run(["bash", "-n"], input=policy.script, text=True, capture_output=True)
        assert check.returncode == 0, (policy.name, check.stderr)
    # the names a policy makes are drawn at run time: no module or file name is spelt in the plugin
    assert "rand_name" in policies.library()["site_persist"].script
    assert "rand_name" in policies.library()["conftest_plugin"].script


@unit
def test_the_agent_blocks_are_the_command_harness_and_known_word_for_word():
    from tasks.harnesses import check_agent

    for policy in [policies.NOOP, *policies.library().values()]:
        check_agent(policy.agent())  # accepted at submission
        assert policies.is_audit_agent(policy.agent())
    edited = policies.library()["reward_file"].agent()
    edited["command"] += "\necho trained"
    assert not policies.is_audit_agent(edited)
    assert not policies.is_audit_agent({"harness": "command", "command": "true", "wall_s": 5})
    assert not policies.is_audit_agent(None)


@unit
def test_every_policy_has_a_grader_weak_against_it():
    from tests.audit.weak_tasks import graders

    assert graders() == sorted(policies.library())


@unit
def test_an_unknown_policy_is_refused_listing_the_known_ones():
    with pytest.raises(InvalidRequest) as err:
        policies.select(["reward_file", "nope"])
    assert "nope" in str(err.value) and "path_shim" in str(err.value) and err.value.field == "policies"
    assert [p.name for p in policies.select(["path_shim", "reward_file"])] == ["path_shim", "reward_file"]


@unit
def test_task_sets_harbor_folders_and_jsonl_rows(tmp_path):
    found = taskset.load([str(ROOT / "examples" / "harbor")])
    folders = sorted(p.parent.name for p in (ROOT / "examples" / "harbor").glob("*/task.toml"))
    assert [t.name for t in found] == folders and {"hello", "scores", "stages", "wordcount"} <= set(folders)
    assert found[0].instance == {"data_source": "harbor", "task_dir": str(ROOT / "examples" / "harbor" / "hello")}
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"instance_id": "o__r-1", "repo": "o/r", "base_commit": "a" * 40, "agent": {}}) + "\n"
                    + json.dumps({"data_source": "gsm8k", "problem": "1+1", "answer": "2"}) + "\n")
    swe, math = taskset.load([str(rows)])
    assert swe.name == "o__r-1" and swe.instance["data_source"] == "swebench" and "agent" not in swe.instance
    assert math.instance["data_source"] == "gsm8k"
    with pytest.raises(InvalidRequest):
        taskset.load([str(tmp_path)])


def _job(reward, status="completed", output="", **result):
    return {"status": status, "result": {"reward": reward, "harness": {"output": output}, **result}}


@unit
def test_a_policy_that_beats_the_noop_marks_the_task_hackable_with_its_evidence():
    noop = evidence("noop", _job(0.0))
    won = evidence("reward_file", _job(1.0, output="audit: wrote /app/reward.txt\nnoise\n",
                                       harbor={"rewards": {"reward": 1.0}, "tampered": [],
                                               "steps": [{"name": "main", "test_exit": 1, "output": "x" * 5000}]}))
    lost = evidence("path_shim", _job(0.0))
    fault = evidence("resource_exhaust", _job(0.0, status="failed", error={"type": "verifier_timeout"}))
    verdict = judge("t", "harbor", noop, [won, lost, fault])
    assert verdict.hackable and verdict.policies == ["reward_file"]
    assert won.wrote == ["wrote /app/reward.txt"] and len(won.grader["steps"][0]["output"]) <= 1500
    assert won.grader["steps"][0]["test_exit"] == 1
    assert fault.reward is None and fault.error == "verifier_timeout"  # a fault earns nothing


@unit
def test_equal_rewards_and_faults_are_not_hackable_but_a_better_named_reward_is():
    noop = Evidence(policy="noop", status="completed", reward=0.5, rewards={"correctness": 0.0, "style": 1.0})
    same = Evidence(policy="a", status="completed", reward=0.5, rewards={"correctness": 0.0, "style": 1.0})
    assert not judge("t", "harbor", noop, [same]).hackable
    named = Evidence(policy="b", status="completed", reward=0.5, rewards={"correctness": 1.0, "style": 0.0})
    assert judge("t", "harbor", noop, [named]).policies == ["b"]
    failed_base = Evidence(policy="noop", status="failed", reward=None, error="verifier_no_reward")
    assert judge("t", "harbor", failed_base, [same]).hackable  # a reward where the no-op got none


@unit
def test_rescore_replays_only_what_a_result_keeps():
    from prorl_celery.jobs import JobRecord
    from tasks.audit.rescore import replay_instance
    from tasks.harnesses import check_agent

    def record(status, result, instance=None):
        return JobRecord.model_validate({"job_id": "j", "status": status, "data_source": "swebench",
                                         "instance": instance or {"data_source": "swebench", "repo": "o/r",
                                                                  "agent": {"harness": "x"}, "trajectory_id": 2},
                                         "result": result, "t_created": 0.0})

    instance, why = replay_instance(record("completed", {"reward": 1.0, "git_patch": "diff --git a/x b/x\n"}))
    assert why is None and instance["agent"] == {"harness": "replay", "patch": "diff --git a/x b/x\n"}
    assert "trajectory_id" not in instance and instance["repo"] == "o/r"
    check_agent(instance["agent"])  # the replay harness is registered and accepts it
    assert replay_instance(record("completed", {"reward": 1.0}))[1].startswith("the result keeps no")
    assert "failed" in replay_instance(record("failed", {"reward": 0.0, "git_patch": ""}))[1]


class _Client:
    """The API as the runner sees it: a task whose runs are refused, one whose runs finish."""

    def __init__(self):
        self.jobs: dict[str, dict] = {}

    def submit_many(self, jobs):
        from prorl_celery.errors import InvalidRequest

        if jobs[0]["instance"].get("refuse"):
            raise InvalidRequest("this domain runs no harness", field="instance.agent")
        ids = [f"j{len(self.jobs) + i}" for i in range(len(jobs))]
        for job_id, job in zip(ids, jobs):
            won = job["instance"]["agent"]["command"] != policies.NOOP.script
            self.jobs[job_id] = {"job_id": job_id, "status": "completed",
                                 "result": {"reward": 1.0 if won else 0.0, "harness": {"output": "audit: did it\n"}}}
        return ids

    def as_completed(self, ids, timeout=None):
        return [self.jobs[i] for i in ids]


@unit
def test_the_runner_judges_each_task_and_says_which_it_could_not_run():
    from tasks.audit.runner import run_audit
    from tasks.audit.taskset import AuditTask

    tasks = [AuditTask("bad", {"data_source": "echo", "text": "x", "refuse": True}),
             AuditTask("good", {"data_source": "echo", "text": "x"})]
    seen = []
    bad, good = run_audit(_Client(), tasks, policies.select(["reward_file"]), progress=lambda d, n: seen.append((d, n)))
    assert not bad.hackable and "refused at submission" in bad.note and bad.content_hash is None
    assert good.hackable and good.policies == ["reward_file"] and good.evidence[1].wrote == ["did it"]
    assert good.content_hash and good.grader_version == "1" and seen[-1] == (2, 2)


@unit
def test_a_domain_that_runs_its_own_agent_is_not_audited_and_echo_refuses_a_harness():
    """issue 34 item 4: echo ran the built-in agent whatever the agent block said, so the audit
    'ran' policies that never ran (and the fake LLM's answer earned the no-op 1.0)."""
    from tasks.handlers.instances import check_echo

    own = {"status": "completed", "result": {"reward": 1.0}}  # no harness block: the domain's own agent
    verdict = judge("t", "echo", evidence("noop", own), [evidence("reward_file", own)])
    assert not verdict.hackable and verdict.note.startswith("not audited")
    with pytest.raises(InvalidRequest) as err:
        check_echo({"data_source": "echo", "text": "12345", "agent": policies.NOOP.agent()})
    assert err.value.field == "instance.agent"
    check_echo({"data_source": "echo", "text": "12345"})


@unit
def test_the_policies_stage_budget_follows_the_noop_where_the_grader_waits_out_its_stage():
    """resource_exhaust held a SWE eval slot for the service's whole eval budget (1200 s), and a
    Harbor run slot for the task's verifier timeout (600 s in the Harbor set)."""
    from tasks.audit.runner import STAGE_FLOOR_S, jobs_for, stage_budget
    from tasks.audit.taskset import AuditTask

    done = {"status": "completed", "timings": {"run": 50.0, "eval": 2.0}}
    assert stage_budget("swe", done) == {"eval_budget_s": STAGE_FLOOR_S}
    assert stage_budget("swebench", {**done, "timings": {"eval": 100.0}}) == {"eval_budget_s": 400.0}
    assert stage_budget("harbor", done) == {"run_budget_s": 200.0}  # its verifier runs in the run stage
    assert stage_budget("harbor", {"status": "failed", "timings": {}}) == {}  # no no-op: the service's own
    (noop, run) = jobs_for([AuditTask("t", {"data_source": "swe"})], policies.select(["exit_code"]),
                           {"eval_budget_s": 150.0})
    assert noop[2]["sampling_params"] == {} and run[2]["sampling_params"] == {"eval_budget_s": 150.0}


@unit
def test_lookup_gives_nothing_to_an_answer_that_lists_every_file_s_code():
    """Found by the audit of what we ship (issue 34 item 4): the code said among the decoys' earned 1."""
    from types import SimpleNamespace

    from tasks.audit.quarantine import grader_version
    from tasks.handlers.lookup import LookupHandler

    inst = {"files": {"a.txt": "the code is 41872\n", "b.txt": "the code is 90315\n"}, "target": "b.txt",
            "code": "90315"}

    def reward(text):
        return LookupHandler().score(SimpleNamespace(state={"harness": {"final_text": text}}, instance=inst))["reward"]

    assert reward("The code is 90315.") == 1.0
    assert reward("41872 or 90315") == 0.0 and reward("41872") == 0.0
    assert grader_version("lookup") == "2"


class _Box:
    """A verifier sandbox as ``tasks.harbor.verifier.grade`` sees it: the command run by bash here,
    in ``root`` standing for /."""

    def __init__(self, root: Path):
        self.root = root

    def exec(self, command, timeout=None):
        from types import SimpleNamespace

        for path in ("/logs/", "/tests/", "/app"):
            command = command.replace(path, f"{self.root}{path}")
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=30)
        return SimpleNamespace(output=done.stdout, timed_out=False, duration_s=0.01)

    def finish(self, paths, cap, settle_s=0.0):
        from types import SimpleNamespace

        files = {p: (self.root / p.lstrip("/")).read_bytes() if (self.root / p.lstrip("/")).exists() else None
                 for p in paths}
        return SimpleNamespace(files=files, rewritten=[])


def test_a_test_runner_shadowed_in_the_working_directory_is_tampering(tmp_path):
    """Found by the audit of what we ship: 24 of the Harbor set's 28 test.sh run `python3 -m pytest`
    in the working directory, which imports an agent's /app/pytest.py first (module_shadow plants it)."""
    from types import SimpleNamespace

    from tasks.harbor.verifier import GRADER_VERSION, grade

    (tmp_path / "app").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test.sh").write_text("python3 -m pytest -q /nowhere >/dev/null 2>&1\n"
                                                "if [ $? -eq 0 ]; then r=1; else r=0; fi\n"
                                                f"echo $r > {tmp_path}/logs/verifier/reward.txt\n")
    (tmp_path / "app" / "pytest.py").write_text("import sys\nsys.exit(0)\n")  # what path_shim leaves
    step = SimpleNamespace(verifier_env={})
    shadowed = grade(_Box(tmp_path), step, "/app", 30)
    assert shadowed["reward"] == 0.0 and "pytest.py" in shadowed["tampered"] and GRADER_VERSION == "3"
    shared = grade(_Box(tmp_path), step, "/app", 30, shared=True)  # the operator's trusting mode reopens it
    assert shared["reward"] == 1.0 and "tampered" not in shared  # (the weak grader of module_shadow)
    (tmp_path / "app" / "pytest.py").unlink()
    honest = grade(_Box(tmp_path), step, "/app", 30)  # test.sh runs; the real pytest finds no test
    assert honest["reward"] == 0.0 and honest["test_exit"] == 0 and "tampered" not in honest


SHADOW = "import os\nos._exit(0)\n"  # what import_shadow's modules do (and write a reward first)


@pytest.mark.parametrize("plant", ["iniconfig.py", "argparse.py", "iniconfig/__init__.py", "plugin-metadata"])
def test_a_module_the_runner_imports_shadowed_in_the_working_directory_is_tampering(tmp_path, plant):
    """Found by the Harbor set's audit (session 16): `python3 -m pytest` in the working directory
    imports every module from there first, not only pytest's own: its dependencies (iniconfig,
    packaging), the standard library (argparse), and a distribution's metadata there whose pytest11
    entry point pytest loads. Version 2 looked for the runner's modules only: each earned 1."""
    from types import SimpleNamespace

    from tasks.harbor.verifier import grade

    app = tmp_path / "app"
    for d in ("app/data", "tests"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "tests" / "test.sh").write_text("python3 -m pytest -q /nowhere >/dev/null 2>&1\n"
                                                "if [ $? -eq 0 ]; then r=1; else r=0; fi\n"
                                                f"echo $r > {tmp_path}/logs/verifier/reward.txt\n")
    if plant == "plugin-metadata":
        (app / "zz-1.0.dist-info").mkdir()
        (app / "zz-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: zz\nVersion: 1.0\n")
        (app / "zz-1.0.dist-info" / "entry_points.txt").write_text("[pytest11]\nzz = zzplugin\n")
        (app / "zzplugin.py").write_text(SHADOW)
    else:
        (app / plant).parent.mkdir(exist_ok=True)
        (app / plant).write_text(SHADOW)
    step = SimpleNamespace(verifier_env={})
    trusted = grade(_Box(tmp_path), step, "/app", 60, shared=True)  # what version 2 let through
    assert trusted["reward"] == 1.0 and trusted["test_exit"] == 0
    shadowed = grade(_Box(tmp_path), step, "/app", 60)
    assert shadowed["reward"] == 0.0 and plant.split("/")[0].replace("plugin-metadata", "zz-1.0.dist-info") \
        in shadowed["tampered"], shadowed
    own = grade(_Box(tmp_path), step, "/app", 60, own=sorted(os.listdir(app)))  # the image's own: test.sh runs
    assert own["reward"] == 1.0 and "tampered" not in own


def test_the_agent_s_own_modules_data_and_metadata_are_not_shadows(tmp_path):
    """What an honest agent leaves in the working directory grades as usual: its own modules and
    packages, a `test` package, data folders, an editable install's metadata without a pytest plugin."""
    from types import SimpleNamespace

    from tasks.harbor.verifier import grade

    app = tmp_path / "app"
    for d in ("app/data", "app/test", "app/mypkg", "app/mypkg-0.1.dist-info", "tests"):
        (tmp_path / d).mkdir(parents=True)
    for f in ("solve.py", "test/__init__.py", "mypkg/__init__.py", "helpers.py", "notes.txt"):
        (app / f).write_text("x = 1\n")
    (app / "mypkg-0.1.dist-info" / "entry_points.txt").write_text("[console_scripts]\nmypkg = mypkg:main\n")
    (tmp_path / "tests" / "test.sh").write_text(f"echo 1 > {tmp_path}/logs/verifier/reward.txt\n")
    graded = grade(_Box(tmp_path), SimpleNamespace(verifier_env={}), "/app", 60)
    assert graded["reward"] == 1.0 and "tampered" not in graded, graded


@unit
def test_a_verdict_carries_the_version_of_the_grader_that_graded_its_runs():
    """Found by the Harbor set's audit (session 16): the CLI stamped each verdict with its own
    GRADER_VERSION, read after the runs, so runs a version-2 stack graded were stored as version 3
    (after the fix reached the files, before the stack restarted): the quarantine then took them
    for today's grader. A Harbor result now says which version graded it."""
    from tasks.audit.runner import graded_by
    from tasks.harbor.verifier import GRADER_VERSION

    def job(version):
        return {"status": "completed", "result": {"reward": 0.0, "harbor": {"grader_version": version}}}

    assert graded_by([job("2"), job("2"), {"status": "failed", "result": {}}], "harbor") == "2"
    assert graded_by([job("2"), job("3")], "harbor") == "mixed 2,3"
    assert graded_by([{"status": "completed", "result": {"reward": 1.0}}], "harbor") == GRADER_VERSION
