"""A model learns as an agent through a black-box harness (``pytest -m learning``, up to 40
minutes of both cores): examples/harness_grpo.py, asynchronous TRL GRPO on SmolLM2-135M on the
two-turn ``lookup`` task, each episode examples/lookup_agent.py (an ordinary OpenAI client) in a
sandbox behind the service's gateway, for 24 steps.

What it asserts is the goal of the run — batch reward of the last 5 steps at least 0.3 above the
first 5, held-out sampled accuracy up by at least 0.2, in 40 minutes at most, at least two
generated turns per episode on median — and the mask: in every batch TRL trained on, every run
of ids at loss mask 1 is an answer the gateway recorded the model generating
(``untrained_by_record``; the observation between the two calls, the harness's own prompt text,
never), while the observations are there
(a share of the ids is masked) and no row was dropped.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.learning.conftest import run_example

pytestmark = [pytest.mark.learning, pytest.mark.timeout(3600)]
STEPS = int(os.environ.get("PRORL_LEARNING_STEPS", "24"))  # the example's default
HARNESS = Path("/opt/prorl-harnesses/openai-client")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_example("harness_grpo.py", "harness_grpo", STEPS, tmp_path_factory, harnesses=("openai-client",),
                       needs=(HARNESS / "lookup_agent.py",))


def test_the_agent_learned_within_the_budget(result):
    s = result["summary"]
    assert s["steps"] == STEPS
    assert s["last5"] >= s["first5"] + 0.3, s
    assert s["heldout_after"] >= s["heldout_before"] + 0.2, s
    assert s["minutes"] <= 40, s
    assert s["turns_median"] >= 2, s


def test_no_observation_id_was_trained_on(result):
    steps = result["steps"]
    assert [r["observation_mask_ones"] for r in steps] == [0] * len(steps)
    assert all(r["masked_share"] > 0 for r in steps), [r["masked_share"] for r in steps]
    assert all(not r["dropped"] for r in steps), [r["dropped"] for r in steps]


def test_it_was_asynchronous_with_staleness_at_most_one(result):
    steps = result["steps"]
    assert all(r["lag_max"] <= 1 for r in steps)
    assert all(r["modes"] == ["keep"] for r in steps), [r["modes"] for r in steps]
    assert result["summary"]["unconsumed_after"] == 0
