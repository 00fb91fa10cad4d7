"""The agent seam (tasks/agent/runner.py): one runner per instance, the handler's stages through it,
and the result's fields of both kinds read from a typed JobState exactly as from its stored form."""
from __future__ import annotations

import json

import pytest

from prorl_celery.fakes import ScriptedPolicy
from sandboxes.fake import DummySandbox
from tasks.fake import FakeStage
from prorl_celery.jobstate import JobState
from tasks.agent.runner import BUILTIN, BuiltinAgent, runner_for, runner_of
from tasks.handlers import get_handler
from tasks.handlers.agentic import final_answer
from tasks.harnesses.runner import HarnessRunner

pytestmark = pytest.mark.unit

HARNESS = {"data_source": "math", "problem": "1+1", "answer": "2", "agent": {"harness": "command", "command": "true"}}
ENDED = {"name": "command", "session": "s1", "finish_reason": "exited", "exit_code": 0, "output": "done",
         "final_text": "it is \\boxed{2}", "route": "direct", "run_s": 1.5, "llm_s": 1.0, "gateway_s": 0.01,
         "staleness": {"max_staleness": 1, "fence": "mask", "masked_turns": [0], "regenerated_turns": 0,
                       "regenerated_tokens": 0, "max_lag": 2, "turn_versions": [["v0"], ["v2"]]}}
SAVED = {"_rollout": {"calls": 2, "messages": 5}, "_admission": {"wait_s": 0.25, "version": 2}}


def test_each_instance_gets_one_runner():
    assert isinstance(runner_for(HARNESS), HarnessRunner)
    assert runner_for({"data_source": "math"}) is BUILTIN and isinstance(BUILTIN, BuiltinAgent)
    assert runner_for({"data_source": "math", "agent": "not a block"}) is BUILTIN


def test_a_harness_result_is_read_from_its_block_typed_or_stored():
    state = JobState.of({**SAVED, "harness": ENDED, "harness_restarts": 1})
    fields = get_handler("math").result_fields(state)
    assert fields == get_handler("math").result_fields(json.loads(json.dumps(state.dump())))
    assert fields["trajectory"] == {"calls": 2, "messages": 5} and fields["turns"] == 2
    assert fields["harness"] == {"name": "command", "exit_code": 0, "output": "done", "session": "s1",
                                 "route": "direct", "restarts": 1, "sampling": None}
    assert fields["finish_reason"] == "exited" and fields["timing"] == {"llm": 1.0, "harness": 1.5, "gateway": 0.01}
    staleness = fields["staleness"]
    assert staleness["masked_turns"] == [0] and "turn_versions" not in staleness
    assert (staleness["admission_wait_s"], staleness["admitted_version"]) == (0.25, 2)
    assert final_answer(state) == (None, "it is \\boxed{2}")


def test_the_built_in_agents_result_is_read_from_its_episode():
    state = JobState.of({**SAVED, "agent": {"finish_reason": "submit", "answer": "2", "final_text": "",
                                            "llm_s": 0.5, "actions_s": 0.25}})
    fields = get_handler("math").result_fields(state)
    assert fields == {"trajectory": {"calls": 2, "messages": 5}, "turns": 2, "finish_reason": "submit", "answer": "2",
                      "timing": {"llm": 0.5, "actions": 0.25},
                      "staleness": {"admission_wait_s": 0.25, "admitted_version": 2}}
    assert runner_of(state) is BUILTIN and final_answer(state) == ("2", "")
    assert get_handler("math").result_fields({}) == {"trajectory": {"calls": 0, "messages": 0}, "turns": 0,
                                                     "finish_reason": None, "answer": None,
                                                     "timing": {"llm": 0.0, "actions": 0.0}}


def test_a_redelivered_run_finds_its_harness_ended_and_does_not_run_it_again():
    sandbox = DummySandbox()
    stage = FakeStage(HARNESS, state={"harness": ENDED}, resumed=True, sandbox=sandbox)
    get_handler("math").run(stage)  # a harness run would need a gateway and the pool: none here
    assert sandbox.interrupts == 1 and stage.admissions == 1 and stage.saves[-1]["harness"] == ENDED
    assert get_handler("math").eval(stage)["reward"] == 1.0  # graded on the harness's last message


def test_the_built_in_agent_runs_through_the_same_seam():
    stage = FakeStage({"data_source": "gsm8k", "problem": "Sum 1..3", "answer": "6"},
                      policy=ScriptedPolicy(["So \\boxed{6}."]))
    handler = get_handler("gsm8k")
    handler.init(stage)
    handler.run(stage)
    assert stage.state.agent["finish_reason"] == "stop" and handler.eval(stage)["reward"] == 1.0
