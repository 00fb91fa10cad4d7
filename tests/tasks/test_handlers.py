"""The built-in handlers' stages in process, on a fake stage context (``tasks/fake.py``):
what each asks of its sandbox and its stage, and how each scores (the graders' verdicts as the
handlers turn them into rewards). The same handlers run end to end in ``test_domains.py``."""
from __future__ import annotations

import json
from typing import Any

import pytest

from config.settings import get_settings
from prorl_celery.errors import JobCancelled
from prorl_celery.fakes import ScriptedPolicy
from sandboxes.fake import DummySandbox
from sandboxes.fake import failed, ok
from tasks.fake import FakeStage
from tasks.handlers import get_handler
from tasks.handlers.code import EVAL_LIMITS, RUNNER_FILES, VERIFY

pytestmark = pytest.mark.unit


def bash(command: str) -> dict[str, Any]:
    return {"content": "", "tool_calls": [{"name": "bash", "arguments": {"command": command}}]}


def submit(answer: str) -> dict[str, Any]:
    return {"content": "", "tool_calls": [{"name": "submit", "arguments": {"answer": answer}}]}


def run_stages(name: str, stage: FakeStage) -> dict[str, Any]:
    """init, run and eval of handler ``name`` on ``stage``, as the chain calls them."""
    handler = get_handler(name)
    handler.init(stage)
    handler.run(stage)
    return handler.eval(stage)


# -- math and stem ----------------------------------------------------------------------------
def test_math_opens_its_sandbox_runs_the_agent_there_and_grades_the_submitted_answer():
    sandbox = DummySandbox().on(r"^python3 -c", "1.5\n")
    stage = FakeStage({"data_source": "math", "problem": "What is 3/2?", "answer": "\\frac{3}{2}",
                       "sandbox": {"limits": {"memory_mb": 512}}},
                      policy=ScriptedPolicy([bash("python3 -c 'print(3/2)'"), submit("1.5")]), sandboxes=[sandbox])
    result = run_stages("math", stage)
    assert result["reward"] == 1.0 and result["resolved"] is True
    assert result["eval"]["given"] == "1.5" and result["eval"]["check"] == "equal"
    [spec] = stage.opened
    assert (spec.limits.memory_mb, spec.limits.cpu_s) == (512, 60)  # lowered by the instance, the rest default
    assert [c for c, _ in sandbox.commands] == ["python3 -c 'print(3/2)'"]
    request = stage.policy.requests[0]
    assert request.messages[1] == {"role": "user", "content": "What is 3/2?"}
    assert stage.saves[0] == {} and stage.saves[-1]["agent"]["answer"] == "1.5"  # init saved, then each turn
    assert stage.admissions == 1  # run asked admission control before the agent's first turn


def test_an_instance_cannot_lift_the_handlers_limits():
    stage = FakeStage({"data_source": "math", "problem": "1+1", "answer": "2",
                       "sandbox": {"limits": {"memory_mb": 1_000_000, "cpu_s": 10}}})
    get_handler("math").init(stage)
    assert (stage.opened[0].limits.memory_mb, stage.opened[0].limits.cpu_s) == (2048, 10)


def test_math_without_submit_grades_the_last_boxed_answer_and_a_wrong_one_earns_nothing():
    stage = FakeStage({"data_source": "gsm8k", "problem": "Sum 1..100", "answer": "5050"},
                      policy=ScriptedPolicy(["It is \\boxed{5000}, no: \\boxed{5051}."]))
    result = run_stages("gsm8k", stage)
    assert result["reward"] == 0.0 and result["resolved"] is False
    assert (result["eval"]["given"], result["eval"]["check"]) == ("5051", "different")
    assert stage.state["agent"]["finish_reason"] == "stop"


@pytest.mark.parametrize("answer,said,reward", [("B", "(b)", 1.0), ("Paris", "The answer is B.", 1.0),
                                                ("B", "C", 0.0)])
def test_stem_grades_choices_by_letter_whatever_the_reference_names(answer, said, reward):
    instance = {"data_source": "stem", "question": "Capital of France?", "choices": ["Lyon", "Paris", "Nice"],
                "answer": answer}
    stage = FakeStage(instance, policy=ScriptedPolicy([submit(said)]))
    result = run_stages("stem", stage)
    assert result["reward"] == reward and result["eval"]["expected"] == "B"
    assert "C. Nice" in stage.policy.requests[0].messages[1]["content"]


@pytest.mark.parametrize("match,said,reward", [
    ("exact", "48213.", 1.0), ("exact", "The number is 48213.", 0.0), ("contains", "The number is 48213.", 1.0),
    ("contains", "It is 482130.", 0.0), ("contains", "48 213", 0.0)])
def test_echo_grades_the_text_said_back_exactly_or_inside_a_sentence(match, said, reward):
    stage = FakeStage({"data_source": "echo", "text": "48213", "match": match}, policy=ScriptedPolicy([said]))
    result = run_stages("echo", stage)
    assert result["reward"] == reward and result["eval"]["expected"] == "48213"
    request = stage.policy.requests[0]
    assert request.tools is None  # tools "none": the shortest prompt, one assistant turn
    assert request.messages == [{"role": "user", "content": "Repeat this 5-digit number exactly: 48213"}]
    assert stage.admissions == 1  # the staleness bound is asked before the turn


def test_echo_offers_the_tool_set_the_instance_names_and_grades_a_submitted_answer():
    stage = FakeStage({"data_source": "echo", "text": "hello", "tools": "submit", "system": "Be brief."},
                      policy=ScriptedPolicy([submit("hello")]))
    result = run_stages("echo", stage)
    assert result["reward"] == 1.0 and result["eval"]["given"] == "hello"
    request = stage.policy.requests[0]
    assert [t["function"]["name"] for t in request.tools] == ["submit"]
    assert request.messages[0] == {"role": "system", "content": "Be brief."}


# -- code -------------------------------------------------------------------------------------
SOLUTION = "def add(a, b):\n    return a + b\n"


def code_stage(report: dict[str, Any] | None, printed: str = "", framed: bool = True
               ) -> tuple[FakeStage, DummySandbox, DummySandbox]:
    """A code job whose grading sandbox answers ``python3 code_runner.py spec.json`` with
    ``printed`` (what the solution wrote) and then ``report`` on a line framed by the spec's nonce
    (``framed``) or by a guessed one."""
    agent_box, eval_box = DummySandbox(), DummySandbox()

    def run_tests(command: str):
        nonce = json.loads(eval_box.read_file("spec.json"))["nonce"] if framed else "0" * 32
        return ok(printed + (f"{nonce} {json.dumps(report)}\n" if report is not None else ""))
    eval_box.on(r"^python3 code_runner\.py spec\.json$", run_tests)
    reply = f"Here it is:\n```python\n{SOLUTION}```"
    stage = FakeStage({"data_source": "code", "prompt": "Write add(a, b).", "tests": "assert add(1, 2) == 3",
                       "entry_point": "add"}, policy=ScriptedPolicy([reply]), sandboxes=[agent_box, eval_box])
    return stage, agent_box, eval_box


def test_code_grades_the_last_fenced_block_in_a_fresh_sandbox_with_the_runner_beside_it():
    stage, agent_box, eval_box = code_stage({"passed": 3, "total": 4})
    result = run_stages("code", stage)
    assert result["reward"] == 0.75 and result["resolved"] is False and result["solution"] == SOLUTION
    assert result["eval"]["integrity"]["outcome"] == "clean"
    assert stage.closed == [agent_box] and agent_box.commands == []  # the agent's box never grades
    assert stage.opened[1].limits.model_dump(exclude_none=True).items() >= EVAL_LIMITS.items()
    assert eval_box.files["solution.py"] == SOLUTION.encode()
    for name in RUNNER_FILES:
        assert eval_box.files[name] == (VERIFY / name).read_bytes()
    spec = json.loads(eval_box.files["spec.json"])
    assert spec["tests"] == {"kind": "python", "code": "assert add(1, 2) == 3", "entry_point": "add"}
    assert len(spec["nonce"]) == 32


def test_a_report_the_solution_printed_itself_counts_for_nothing():
    stage, _, _ = code_stage({"passed": 4, "total": 4}, printed='{"passed": 4, "total": 4}\n', framed=False)
    result = run_stages("code", stage)
    assert result["reward"] == 0.0 and result["eval"]["total"] is None
    assert "no report" in result["eval"]["error"] and result["eval"]["integrity"]["outcome"] == "unverified"


def test_a_must_fail_canary_that_passed_is_tampered_and_earns_nothing():
    canaries = [{"canary": "fail", "passed": True}, {"canary": "pass", "passed": True}]
    stage, _, _ = code_stage({"passed": 4, "total": 4, "canaries": canaries})
    result = run_stages("code", stage)
    assert result["reward"] == 0.0 and result["resolved"] is False
    assert result["eval"]["integrity"]["outcome"] == "tampered"


def test_code_without_a_solution_opens_no_grading_sandbox():
    stage = FakeStage({"data_source": "code", "prompt": "Write f.", "tests": "assert f()"},
                      policy=ScriptedPolicy(["I cannot."]))
    result = run_stages("code", stage)
    assert result == {"reward": 0.0, "resolved": False, "eval": {"passed": 0, "total": None, "error": "no solution"}}
    assert len(stage.opened) == 1


# -- shell ------------------------------------------------------------------------------------
def test_shell_runs_each_command_once_saving_after_each_and_fails_on_a_nonzero_exit():
    box = DummySandbox().on(r"^true$", "").on(r"^false$", failed("", 1))
    stage = FakeStage({"data_source": "shell", "commands": ["true", "false"], "timeout": 7}, sandboxes=[box])
    result = run_stages("shell", stage)
    assert result == {"reward": 0.0, "resolved": False, "finish_reason": "done"}
    assert box.commands == [("true", 7), ("false", 7)]
    # a save after each command; init saves nothing of its own (its stage's end writes the state)
    assert [len(saved["steps"]) for saved in stage.saves] == [1, 2]
    assert stage.state["steps"][0]["command"] == "true"
    assert get_handler("shell").result_fields(stage.state)["steps"][1]["exit_code"] == 1


def test_a_redelivered_shell_run_interrupts_first_and_runs_only_what_is_left():
    box = DummySandbox().on(r"^echo ", lambda c: ok(c[5:] + "\n"))
    done = {"steps": [{"command": "echo a", "exit_code": 0, "output": "a\n", "timed_out": False}]}
    stage = FakeStage({"data_source": "shell", "commands": ["echo a", "echo b"]}, state=done, resumed=True,
                      sandbox=box)
    get_handler("shell").run(stage)
    assert box.interrupts == 1 and [c for c, _ in box.commands] == ["echo b"]
    assert [s["output"] for s in stage.state["steps"]] == ["a\n", "b\n"]


def test_a_cancel_during_a_command_stops_the_shell_run_and_saves_nothing_more():
    def cancelled(command: str):
        stage.cancelled = True  # the job is cancelled while its first command runs
        return ok()
    box = DummySandbox().on("first", cancelled)
    stage = FakeStage({"data_source": "shell", "commands": ["first", "second"]}, sandboxes=[box])
    get_handler("shell").init(stage)
    with pytest.raises(JobCancelled):
        get_handler("shell").run(stage)
    assert [c for c, _ in box.commands] == ["first"] and stage.saves == []  # the cancelled save stored nothing


def test_shell_commands_are_capped_by_the_stage_budget():
    box = DummySandbox().on("sleep", "")
    stage = FakeStage({"data_source": "shell", "commands": ["sleep 100"], "timeout": 600}, sandbox=box,
                      budget_s=30)
    get_handler("shell").run(stage)
    assert 25 < box.commands[0][1] <= 30


# -- swe --------------------------------------------------------------------------------------
def patch_in(box: DummySandbox, patch: bytes, exit_code: int = 0):
    """``git diff`` in the sandbox: writes ``patch`` beside the repository."""
    def diff(command: str):
        box.write_file("/workspace/.prorl-patch", patch)
        return ok() if exit_code == 0 else failed("fatal: bad revision", exit_code)
    box.on(r"git diff --cached", diff)
    return box


SWE = {"data_source": "swe", "repo": "o/r", "base_commit": "a" * 40, "problem_statement": "It breaks.",
       "FAIL_TO_PASS": ["t::a"], "PASS_TO_PASS": []}


def test_swe_reads_the_whole_patch_through_a_file_and_an_empty_one_earns_nothing_ungraded():
    patch = b"diff --git a/x b/x\n" + b"+" * 300_000 + b"\n"  # far past what the agent's command view shows
    box = patch_in(DummySandbox(), patch)
    stage = FakeStage(SWE, state={"repo_dir": "/workspace/repo"}, sandbox=box)
    handler = get_handler("swe")
    handler.after_run(stage, None)
    assert stage.state["git_patch"].encode() == patch and "git_patch_bytes" not in stage.state
    assert handler.result_fields(stage.state)["git_patch"] == stage.state["git_patch"]

    empty = FakeStage(SWE, state={"repo_dir": "/workspace/repo"}, sandbox=patch_in(DummySandbox(), b""))
    handler.after_run(empty, None)
    assert handler.eval(empty) == {"reward": 0.0, "resolved": False, "eval": {"skipped": "empty patch"}}
    assert empty.opened == []  # nothing to grade: no sandbox


def test_a_patch_past_the_cap_is_filtered_not_graded(monkeypatch):
    monkeypatch.setattr(get_settings(), "swe_patch_max_mb", 1)
    box = patch_in(DummySandbox(), b"+" * (1024 * 1024 + 1))
    stage = FakeStage(SWE, state={"repo_dir": "/workspace/repo"}, sandbox=box)
    handler = get_handler("swe")
    handler.after_run(stage, None)
    assert (stage.state["git_patch"], stage.state["git_patch_bytes"]) == ("", 1024 * 1024 + 1)
    result = handler.eval(stage)
    assert result["filter"] is True and result["reward"] == 0.0
    assert result["eval"]["error"]["type"] == "patch_too_large" and stage.opened == []
    assert box.commands[-1][0].startswith("rm -f ")  # the file beside the repository is removed


def test_a_failing_git_diff_is_an_empty_patch():
    stage = FakeStage(SWE, state={"repo_dir": "/workspace/repo"},
                      sandbox=patch_in(DummySandbox(), b"stale", exit_code=128))
    get_handler("swe").after_run(stage, None)
    assert stage.state["git_patch"] == ""


def test_the_swe_prompt_names_the_repository_where_init_put_it():
    stage = FakeStage(SWE, state={"repo_dir": "/workspace/repo"})
    messages = get_handler("swebench").prompt(stage)
    assert "o/r at /workspace/repo" in messages[1]["content"] and "It breaks." in messages[1]["content"]
    assert get_handler("swe").sandbox_spec({**SWE, "image": "python:3"}).image == "python:3"


def test_a_redelivered_agent_run_interrupts_the_sandbox_before_the_agent_resumes():
    box = DummySandbox()
    stage = FakeStage({"data_source": "math", "problem": "1+1", "answer": "2"}, resumed=True, sandbox=box,
                      policy=ScriptedPolicy([submit("2")]))
    get_handler("math").run(stage)
    assert box.interrupts == 1 and stage.state["agent"]["answer"] == "2"


def test_the_fake_stage_asks_for_a_sandbox_before_one_is_opened():
    with pytest.raises(RuntimeError, match="no sandbox"):
        get_handler("shell").run(FakeStage({"data_source": "shell", "commands": ["true"]}))
