"""JobState: the service's keys of a job's state typed, a handler's own keys as on a dict, and the
stored form the dict it always was (a job saved before the type reads back the same)."""
from __future__ import annotations

import copy
import json

import pytest

from prorl_celery.jobstate import Admission, JobState, RolloutCounts

pytestmark = pytest.mark.unit

STORED = {"_rollout": {"calls": 3, "messages": 5}, "_admission": {"wait_s": 0.5, "version": 2},
          "_sandbox": {"runtime": "bwrap"}, "_init_wait_s": 1.25, "agent": {"turns": 3, "history": {}},
          "harness_restarts": 1, "repo_dir": "/workspace/repo", "steps": [{"exit_code": 0}]}


def test_the_stored_form_reads_back_typed_and_dumps_the_same():
    state = JobState.of(json.loads(json.dumps(STORED)))
    assert state.rollout == RolloutCounts(calls=3, messages=5) and state.admission == Admission(wait_s=0.5, version=2)
    assert state.init_wait_s == 1.25 and state.sandbox == {"runtime": "bwrap"} and state.harness is None
    assert state.dump() == STORED and json.loads(json.dumps(state.dump())) == STORED
    assert JobState.of(state) is state and JobState.of(None).dump() == {}


def test_a_handlers_code_reads_and_writes_it_as_a_dict():
    state = JobState.of({})
    state["repo_dir"] = "/r"
    steps = state.setdefault("steps", [])
    steps.append(1)  # the list it stores, not a copy
    episode = state.setdefault("agent", {})
    episode["turns"] = 2  # the built-in agent's episode is kept in place too
    assert state["steps"] == [1] and state["agent"] == {"turns": 2} and state.agent == {"turns": 2}
    assert "repo_dir" in state and "harness" not in state and "_rollout" not in state
    assert state.get("missing", 7) == 7 and state.get("_admission") is None
    with pytest.raises(KeyError):
        state["_rollout"]
    state["_rollout"] = {"calls": 1, "messages": 1}  # a known key is validated into its type
    assert state.rollout == RolloutCounts(calls=1, messages=1) and state["_rollout"].calls == 1
    assert dict(state)["repo_dir"] == "/r" and sorted(state.keys()) == ["_rollout", "agent", "repo_dir", "steps"]
    assert state.pop("agent") == {"turns": 2} and state.agent is None and "agent" not in state.dump()
    assert state.pop("repo_dir") == "/r" and state.pop("repo_dir", None) is None
    with pytest.raises(KeyError):
        state.pop("repo_dir")


def test_a_handler_key_named_like_a_field_stays_the_handlers():
    state = JobState.of({"sandbox": "mine", "rollout": 1})
    assert state.sandbox is None and state.rollout is None  # the fields are _sandbox and _rollout
    assert state["sandbox"] == "mine" and state.dump() == {"sandbox": "mine", "rollout": 1}


def test_a_copy_is_a_copy():
    state = JobState.of(copy.deepcopy(STORED))
    other = copy.deepcopy(state)
    other["agent"]["turns"] = 9
    other["steps"].append({})
    assert state.dump() == STORED
