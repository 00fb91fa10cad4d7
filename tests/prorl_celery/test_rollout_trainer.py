"""A finished job as the trajectory a trainer consumes (prorl_celery/rollout/trainer.py): never a
rollout that did not happen, nor ids that are missing or (when exact ones are asked for) approximate."""
from __future__ import annotations

import pytest

from prorl_celery.errors import RolloutFailed
from prorl_celery.rollout.trainer import Trajectory, trajectory, untrained_by_record

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


def _segmented_view() -> dict:
    """A harness result of three calls: the first two chain, the third (a compaction) does not."""
    from prorl_celery.rollout.segments import harness_fields
    from prorl_celery.rollout.store import Call

    calls = [Call(0, [1, 2, 3], [4, 5], [-0.4, -0.5], {"weight_version": "v1"}),
             Call(5, [6], [7], [-0.7], {"weight_version": "v1"}),
             Call(0, [9, 8], [10, 11], [-1.0, -1.1], {"weight_version": "v2"})]
    fields = harness_fields(calls)
    assert fields["token_mode"] == "segmented" and len(fields["segments"]) == 2
    return {"job_id": "js", "status": "completed", "timings": {},
            "result": {"tokens": fields["tokens"], "token_mode": "segmented", "reward": 0.5, "turns": 3,
                       "harness": {"segments": fields["segments"], "counts": fields["counts"]}}}


def test_a_segmented_result_splits_into_one_sample_per_segment_in_its_own_context():
    from prorl_celery.rollout.trainer import samples

    first, second = samples(_segmented_view())
    assert (first.prompt_ids, first.response_ids, first.loss_mask) == ([1, 2, 3], [4, 5, 6, 7], [1, 1, 0, 1])
    assert first.logprobs == [-0.4, -0.5, 0.0, -0.7] and first.weight_versions == ["v1", "v1"]
    assert (second.prompt_ids, second.response_ids, second.loss_mask) == ([9, 8], [10, 11], [1, 1])
    assert [s.segment for s in (first, second)] == [0, 1] and {s.segments for s in (first, second)} == {2}
    assert {s.reward for s in (first, second)} == {0.5} and not first.dropped
    # every generated id is trained on exactly once, in the sequence it was sampled in
    assert sum(first.loss_mask) + sum(second.loss_mask) == 5
    assert samples(_segmented_view(), segmented="drop") == []
    with pytest.raises(RolloutFailed, match="segmented"):
        samples(_segmented_view(), segmented="error")
    assert [s.job_id for s in samples(_view())] == ["j1"]  # one sequence: itself


def test_a_trainer_with_one_row_per_prompt_drops_a_segmented_result_visibly_or_fails():
    from prorl_celery.integrations.trl import RolloutFunc, to_trl
    from prorl_celery.rollout.trainer import check_segmented, fixed_row

    row = fixed_row(_segmented_view())
    assert row.dropped == "segmented" and row.loss_mask == [0, 0, 0, 0] and row.response_ids == [4, 5, 6, 7]
    assert row.reward == 0.5  # still in its group's baseline
    with pytest.raises(RolloutFailed, match="segmented"):
        fixed_row(_segmented_view(), segmented="error")
    with pytest.raises(ValueError, match="split needs a trainer"):
        check_segmented("split", fixed=True)

    class Client:  # what RolloutFunc reads from the service: the finished views, then the ack
        def as_completed(self, job_ids, timeout):
            return [_view() if job_id == "j1" else _segmented_view() for job_id in job_ids]

        def ack(self, job_ids):
            self.acked = job_ids

    func = RolloutFunc(Client(), lambda p: {}, keep_history=False)
    rows = func._collect(["j1", "js"])
    batch = to_trl(rows)
    assert batch["prorl_dropped"] == [None, "segmented"] and batch["env_mask"][1] == [0, 0, 0, 0]
    assert batch["env_mask"][0] == [1, 0, 1]
    with pytest.raises(ValueError):
        RolloutFunc(Client(), lambda p: {}, segmented="split")


def _two_calls(mask: list[int], second: list[int]) -> Trajectory:
    """An answer [7, 8], an observation [5, 6, 9, 2] that says what the second answer repeats
    ([6, 9]), then the second answer."""
    return Trajectory(job_id="j", prompt_ids=[1], response_ids=[7, 8, 5, 6, 9, 2, *second], loss_mask=mask,
                      logprobs=[0.0] * len(mask), reward=1.0, token_mode="exact",
                      messages=[{"role": "user"}, {"role": "assistant", "token_ids": [7, 8]},
                                {"role": "assistant", "content": "re-sent", "resent": True},
                                {"role": "user"}, {"role": "assistant", "token_ids": second}])


def test_only_the_recorded_answers_may_be_trained_on():
    # the model repeats its observation word for word: still only its own span is at mask 1
    assert untrained_by_record(_two_calls([1, 1, 0, 0, 0, 0, 1, 1], [6, 9])) == 0
    # an observation's ids at mask 1 are counted, even ones equal to an answer's
    assert untrained_by_record(_two_calls([1, 1, 0, 1, 1, 0, 1, 1], [6, 9])) == 2
    assert untrained_by_record(_two_calls([1, 1, 1, 1, 1, 1, 1, 1], [6, 9])) == 8
    # a turn the staleness fence masked has no run: the others still match
    assert untrained_by_record(_two_calls([0, 0, 0, 0, 0, 0, 1, 1], [6, 9])) == 0
