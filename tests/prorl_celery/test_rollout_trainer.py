"""A finished job as the trajectory a trainer consumes (prorl_celery/rollout/trainer.py): never a
rollout that did not happen, nor ids that are missing or (when exact ones are asked for) approximate."""
from __future__ import annotations

import pytest

from prorl_celery.errors import RolloutFailed
from prorl_celery.rollout.trainer import trajectory

pytestmark = pytest.mark.unit

TOKENS = {"prompt_ids": [1, 2], "response_ids": [3, 4, 5], "loss_mask": [1, 0, 1], "logprobs": [-0.1, 0.0, -0.2]}


def _view(status: str = "completed", **result) -> dict:
    return {"job_id": "j1", "status": status, "timings": {"run": 1.0},
            "result": {"tokens": TOKENS, "token_mode": "exact", "reward": 1, "turns": 2,
                       "messages": [{"role": "user"}, {"role": "assistant", "weight_version": "v1"},
                                    {"role": "assistant", "weight_version": "v2"}], **result}}


def test_a_completed_exact_job_is_its_trajectory():
    out = trajectory(_view(resolved=True, finish_reason="submit"))
    assert (out.job_id, out.prompt_ids, out.response_ids, out.loss_mask) == ("j1", [1, 2], [3, 4, 5], [1, 0, 1])
    assert out.reward == 1.0 and out.turns == 2 and out.weight_versions == ["v1", "v2"]
    assert out.resolved is True and out.finish_reason == "submit" and out.job_timings == {"run": 1.0}


@pytest.mark.parametrize("view,why", [
    (_view("failed", error="boom"), "ended failed: boom"),
    (_view(token_mode="none"), "no token ids"),
    (_view(tokens={**TOKENS, "response_ids": []}), "no token ids"),
    (_view(token_mode="retokenized"), "not exact"),
])
def test_a_job_unfit_to_train_on_is_an_error_of_the_batch(view, why):
    with pytest.raises(RolloutFailed, match=why):
        trajectory(view)


def test_approximate_ids_pass_when_the_trainer_accepts_them():
    assert trajectory(_view(token_mode="retokenized"), require_exact=False).token_mode == "retokenized"
