"""The agent loop in process: every finish reason and exit path, and the trajectory it builds.

No Redis, Celery or HTTP: the policy is ``ScriptedPolicy`` (the fake LLM server's token-mode code
in process), the sandbox ``DummySandbox``; ``test_agent_fakes.py`` holds them to their real
counterparts."""
from __future__ import annotations

import copy
import math
from typing import Any

import pytest

from prorl_celery.errors import (BackendUnavailable, ContextWindowExceeded, JobCancelled, LLMCallCancelled,
                                 LLMTimeout, StageBudgetExceeded)
from prorl_celery.fakes import ScriptedPolicy
from sandboxes.fake import DummySandbox
from sandboxes.fake import failed, timed_out
from prorl_celery.llm.clients.generate import build_prompt
from prorl_celery.llm.models import Turn
from prorl_celery.rollout.transcript import Transcript
from tasks.agent import AgentConfig, DefaultAgent, FinishReason, Timeouts
from prorl_celery.rollout.trajectory import flatten

pytestmark = pytest.mark.unit  # in process (tests/unit_tier.py)

TASK = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Solve it."}]
TIMEOUTS = Timeouts(llm_call_s=30.0, action_s=5.0)


def bash(command: str, **args: Any) -> dict[str, Any]:
    return {"content": "", "tool_calls": [{"name": "bash", "arguments": {"command": command, **args}}]}


def call(name: str, arguments: Any) -> dict[str, Any]:
    return {"content": "", "tool_calls": [{"name": name, "arguments": arguments}]}


def submit(answer: str | None = None) -> dict[str, Any]:
    return call("submit", {} if answer is None else {"answer": answer})


class Stage:
    """A Control and Sink as the run stage's: a deadline, a cancel flag, saved snapshots."""

    def __init__(self, remaining: float = math.inf):
        self.left = remaining
        self.cancelled = False
        self.state: dict[str, Any] = {}
        self.saved: list[dict[str, Any]] = []
        self.transcript = Transcript()  # the conversation and turns (the job's rollout in the store)
        self.transcripts: list[Transcript] = []

    def check(self) -> None:
        if self.cancelled:
            raise JobCancelled("cancelled")
        if self.left <= 0:
            raise StageBudgetExceeded("run stage exceeded its budget")

    def remaining(self) -> float:
        return self.left

    def stopped(self) -> bool:
        return self.cancelled

    def save(self) -> None:
        self.saved.append(copy.deepcopy(self.state))
        self.transcript.mark_saved()
        self.transcripts.append(copy.deepcopy(self.transcript))


def agent(policy: ScriptedPolicy, sandbox: DummySandbox | None = None, stage: Stage | None = None,
          **config: Any) -> tuple[DefaultAgent, Stage]:
    stage = stage or Stage()
    loop = DefaultAgent(policy, sandbox or DummySandbox(), AgentConfig(**config), control=stage, sink=stage,
                        state=stage.state, timeouts=TIMEOUTS, transcript=stage.transcript)
    return loop, stage


def turns(stage: Stage) -> list[Turn]:
    return stage.transcript.turns()


# -- finish reasons -------------------------------------------------------------------------------
def test_submit_ends_with_the_answer_after_running_bash():
    sandbox = DummySandbox().on(r"^echo hi$", "hi\n")
    policy = ScriptedPolicy([bash("echo hi"), submit("42")])
    loop, stage = agent(policy, sandbox)
    outcome = loop.run(TASK)
    assert (outcome.finish_reason, outcome.answer) == (FinishReason.SUBMIT, "42")
    assert stage.state["finish_reason"] == "submit" and stage.state["answer"] == "42"
    assert sandbox.commands == [("echo hi", 5.0)]
    tool = [m for m in stage.transcript.messages if m["role"] == "tool"]
    assert [(m["name"], m["content"]) for m in tool] == [("bash", "hi\n"), ("submit", "Submitted.")]
    assert len(stage.saved) == 2 and "finish_reason" not in stage.saved[0]  # after turn 1, then the end
    assert stage.saved[-1] == stage.state


def test_submit_without_an_answer_is_an_empty_answer():
    outcome = agent(ScriptedPolicy([submit()]))[0].run(TASK)
    assert (outcome.finish_reason, outcome.answer) == (FinishReason.SUBMIT, "")


def test_a_reply_without_tool_calls_stops():
    outcome = agent(ScriptedPolicy(["I am done."]))[0].run(TASK)
    assert (outcome.finish_reason, outcome.final_text, outcome.answer) == (FinishReason.STOP, "I am done.", None)


def test_the_turn_budget_ends_the_episode():
    policy = ScriptedPolicy([bash("true")] * 2)
    loop, stage = agent(policy, DummySandbox().on("true", ""), max_turns=2)
    assert loop.run(TASK).finish_reason is FinishReason.MAX_TURNS
    assert len(policy.requests) == 2 and stage.state["turns"] == 2


def test_the_token_budget_ends_the_episode_once_spent():
    policy = ScriptedPolicy([bash("true")] * 3)
    loop, stage = agent(policy, DummySandbox().on("true", ""), max_total_tokens=60)
    assert loop.run(TASK).finish_reason is FinishReason.MAX_TOKENS
    done = turns(stage)
    assert stage.state["generated"] == sum(len(t.response_ids) for t in done) >= 60
    assert sum(len(t.response_ids) for t in done[:-1]) < 60  # it stops at the first turn that spends it


def test_the_context_window_ends_the_episode():
    """The prompt of turn 2 has no room left in the window: the real clip raises, the loop ends."""
    config = AgentConfig()
    first = len(build_prompt(ScriptedPolicy([]).tok, config.request(list(TASK), None, 1.0)))
    policy = ScriptedPolicy([bash("true"), submit()], max_model_len=first + 40)
    loop, stage = agent(policy, DummySandbox().on("true", "x" * 50))
    assert loop.run(TASK).finish_reason is FinishReason.CONTEXT
    assert stage.state["turns"] == 1 and len(policy.requests) == 2


def test_a_servers_context_error_ends_the_episode():
    loop, _ = agent(ScriptedPolicy([ContextWindowExceeded("prompt too long")]))
    assert loop.run(TASK).finish_reason is FinishReason.CONTEXT


def test_bad_calls_in_a_row_end_the_episode_and_a_good_one_resets_the_count():
    script = [call("nope", {}), call("bash", "[1, 2]"), bash("true"), call("bash", {}), call("oops", {}),
              "<tool_call>{not json</tool_call>"]
    loop, stage = agent(ScriptedPolicy(script), DummySandbox().on("true", ""), max_bad_calls=3)
    assert loop.run(TASK).finish_reason is FinishReason.FORMAT_ERROR
    assert stage.state["turns"] == 6
    bad = [m["content"] for m in stage.transcript.messages if m["role"] in ("tool", "user")][1:]
    assert bad[0].startswith("Error: unknown tool 'nope'") and "JSON object" in bad[1]
    assert "non-empty `command`" in bad[3]
    assert bad[-1].startswith("Your reply could not be used (tool_call)")  # the unparseable block


def test_replies_cut_by_max_tokens_are_format_errors_with_a_hint():
    policy = ScriptedPolicy(["a long answer that does not fit", bash("a long command line")])
    loop, stage = agent(policy, max_tokens=8, max_bad_calls=2)
    assert loop.run(TASK).finish_reason is FinishReason.FORMAT_ERROR
    text, call_ = turns(stage)
    assert (text.finish_reason, text.format_error, len(text.response_ids)) == ("length", "length", 8)
    assert text.response_ids[-1] not in policy.tok.stop_ids  # cut, not ended
    assert call_.format_error == "tool_call"  # cut inside its <tool_call> block: unparseable
    hints = [m["content"] for m in stage.transcript.messages if m["role"] == "user"][1:]
    assert [h.split(")")[0] for h in hints] == ["Your reply could not be used (length",
                                                "Your reply could not be used (tool_call"]


# -- tool errors are observations -------------------------------------------------------------------
def test_an_editor_refusal_is_an_observation_not_a_bad_call():
    script = [call("str_replace_editor", {"command": "view", "path": "missing.py"})] * 3 + [submit("ok")]
    loop, stage = agent(ScriptedPolicy(script), max_bad_calls=1)
    assert loop.run(TASK).finish_reason is FinishReason.SUBMIT
    tool = [m["content"] for m in stage.transcript.messages if m["role"] == "tool"]
    assert tool[0] == "Error: /workspace/missing.py does not exist"


def test_a_timed_out_or_failing_command_is_noted_in_the_observation():
    sandbox = DummySandbox().on("sleep", timed_out("partial\n", 2.0)).on("false", failed("", 3))
    loop, stage = agent(ScriptedPolicy([bash("sleep 9", timeout=2), bash("false"), submit()]), sandbox)
    loop.run(TASK)
    tool = [m["content"] for m in stage.transcript.messages if m["role"] == "tool"]
    assert tool[:2] == ["partial\n\n[the command timed out after 2s and was killed]", "\n[exit code 3]"]
    assert sandbox.commands == [("sleep 9", 2.0), ("false", 5.0)]


def test_a_long_observation_is_clipped_in_the_middle():
    loop, stage = agent(ScriptedPolicy([bash("cat big"), submit()]), DummySandbox().on("cat", "a" * 20000))
    loop.run(TASK)
    content = stage.transcript.messages[3]["content"]
    assert len(content) < 12100 and "[... 8000 characters cut ...]" in content


def test_a_sandbox_failure_raises_and_records_no_finish_reason():
    def lost(command: str):
        raise ConnectionError("sandbox host gone")

    loop, stage = agent(ScriptedPolicy([bash("ls")]), DummySandbox().on("ls", lost))
    with pytest.raises(ConnectionError):
        loop.run(TASK)
    assert "finish_reason" not in stage.state and stage.state["turns"] == 1


# -- the stage's deadline and cancellation, LLM errors ---------------------------------------------------
def test_the_stage_budget_is_recorded_then_raised():
    stage = Stage(remaining=0.0)
    loop, _ = agent(ScriptedPolicy([submit()]), stage=stage)
    with pytest.raises(StageBudgetExceeded):
        loop.run(TASK)
    assert stage.state["finish_reason"] == "budget" and stage.saved[-1]["finish_reason"] == "budget"


def test_timeouts_are_capped_by_the_remaining_time():
    sandbox = DummySandbox().on("make", "")
    policy = ScriptedPolicy([bash("make", timeout=60), submit()])
    loop, _ = agent(policy, sandbox, Stage(remaining=3.0))
    loop.run(TASK)
    assert sandbox.commands == [("make", 3.0)] and policy.requests[0].timeout_s == 3.0


def test_a_cancelled_job_raises_before_the_next_turn():
    stage = Stage()
    sandbox = DummySandbox().on("true", lambda c: (setattr(stage, "cancelled", True), failed("", 0))[1])
    loop, _ = agent(ScriptedPolicy([bash("true"), submit()]), sandbox, stage)
    with pytest.raises(JobCancelled):
        loop.run(TASK)
    assert "finish_reason" not in stage.state and stage.state["turns"] == 1


def test_a_cancel_during_the_llm_call_raises_llm_call_cancelled():
    stage = Stage()
    loop, _ = agent(ScriptedPolicy([submit()]), stage=stage)
    stage.stopped = lambda: True  # type: ignore[method-assign]  # cancelled after check(), before the call
    with pytest.raises(LLMCallCancelled):
        loop.run(TASK)
    assert "finish_reason" not in stage.state


@pytest.mark.parametrize("error", [BackendUnavailable("no backend"), LLMTimeout("timed out")])
def test_an_llm_error_raises_and_keeps_the_turns_so_far(error):
    sandbox = DummySandbox().on("true", "")
    loop, stage = agent(ScriptedPolicy([bash("true"), error]), sandbox)
    with pytest.raises(type(error)):
        loop.run(TASK)
    assert "finish_reason" not in stage.state and stage.saved[-1]["turns"] == 1


# -- resuming (a redelivered run stage) -----------------------------------------------------------------
def test_a_redelivered_stage_continues_from_the_saved_turns():
    sandbox = DummySandbox().on("true", "")
    stage = Stage()
    with pytest.raises(BackendUnavailable):
        agent(ScriptedPolicy([bash("true"), BackendUnavailable("down")]), sandbox, stage)[0].run(TASK)
    saved = Stage()
    saved.state = copy.deepcopy(stage.saved[-1])  # what the job store holds
    saved.transcript = copy.deepcopy(stage.transcripts[-1])
    policy = ScriptedPolicy([submit("7")])
    outcome = agent(policy, sandbox, saved)[0].run(TASK)
    assert (outcome.finish_reason, outcome.answer) == (FinishReason.SUBMIT, "7")
    first, second = turns(saved)
    assert policy.requests[0].previous == first
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.response_ids)] == first.prompt_ids + first.response_ids


def test_a_finished_episode_returns_its_outcome_without_asking_the_policy():
    loop, stage = agent(ScriptedPolicy([submit("5")]))
    loop.run(TASK)
    again = agent(ScriptedPolicy([]), stage=stage)[0].run(TASK)
    assert (again.finish_reason, again.answer) == (FinishReason.SUBMIT, "5")


# -- the trajectory ----------------------------------------------------------------------------------
def test_trajectory_ids_masks_and_logprobs_line_up():
    sandbox = DummySandbox().on("ls", "a.py\n")
    policy = ScriptedPolicy([bash("ls"), submit("done")])
    loop, stage = agent(policy, sandbox)
    loop.run(TASK)
    one, two = turns(stage)
    tokens, mode = flatten([one, two])
    assert mode == "exact" and tokens["prompt_ids"] == one.prompt_ids
    glue = two.prompt_ids[len(one.prompt_ids) + len(one.response_ids):]
    assert tokens["response_ids"] == one.response_ids + glue + two.response_ids
    assert tokens["loss_mask"] == [1] * len(one.response_ids) + [0] * len(glue) + [1] * len(two.response_ids)
    assert tokens["logprobs"] == one.logprobs + [0.0] * len(glue) + two.logprobs
    assert "a.py" in policy.tok.decode(glue)  # the observation is in the unmasked glue, not learned from
    assert [r["response_ids"] for r in policy.fake.records] == [one.response_ids, two.response_ids]
    assert one.response_ids[-1] in policy.tok.stop_ids and len(one.logprobs) == len(one.response_ids)
