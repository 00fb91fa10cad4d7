"""Per-turn staleness fencing in the agent loop, in process: the policy is the fake server's token
code (``ScriptedPolicy``), the weight versions a dict whose current one the test bumps between
turns as a trainer's weight updates would."""
from __future__ import annotations

from collections.abc import Iterable

from prorl_celery.fakes import ScriptedPolicy
from sandboxes.fake import DummySandbox
from prorl_celery.llm.models import WeightSegment
from prorl_celery.rollout.transcript import Transcript
from prorl_celery.rollout.trajectory import flatten_calls, mask_turns, token_versions
from prorl_celery.rollout.store import Call
from tasks.agent import AgentConfig, DefaultAgent
from tasks.agent.fence import StalenessFence
from tests.tasks.test_agent_loop import TASK, TIMEOUTS, bash, submit


class Versions:
    """Ordinals v1 -> 1, v2 -> 2 ...; ``now`` is the current one."""

    def __init__(self) -> None:
        self.now = 1

    def current(self) -> int:
        return self.now

    def ordinals(self, names: Iterable[str | None]) -> dict[str, int]:
        return {n: int(n[1:]) for n in names if n and n.startswith("v")}


class BumpingPolicy(ScriptedPolicy):
    """Before turn k the trainer is at ``plan[k]``; each turn is sampled by that version."""

    def __init__(self, script, versions: Versions, plan: list[int]):
        super().__init__(script, weight_version="v1")
        self.versions, self.plan, self.calls = versions, plan, 0

    def generate(self, request, should_stop):
        self.versions.now = self.plan[min(self.calls, len(self.plan) - 1)]
        self.slot.backend.weight_version = f"v{self.versions.now}"
        self.calls += 1
        return super().generate(request, should_stop)


def _run(policy: ScriptedPolicy, fence: StalenessFence) -> tuple[dict, Transcript]:
    state: dict = {}
    transcript = Transcript()
    agent = DefaultAgent(policy, DummySandbox(), AgentConfig(max_turns=10), state=state, timeouts=TIMEOUTS,
                         transcript=transcript, fence=fence)
    agent.run(list(TASK))
    return state, transcript


def test_mask_fences_turns_more_than_k_behind_and_the_result_masks_their_tokens():
    versions = Versions()
    # turns sampled at v1, v1, v2, v4 (three bumps: v2, v3, v4); k = 1
    policy = BumpingPolicy([bash("ls"), bash("pwd"), bash("id"), submit("done")], versions, [1, 1, 2, 4])
    state, transcript = _run(policy, StalenessFence(versions, 1, "mask"))
    stats = state["staleness"]
    # at the end the trainer is at v4: turns at v1 (lag 3) and v2 (lag 2) are masked, v4 is kept
    assert stats["masked_turns"] == [0, 1, 2] and stats["max_lag_kept"] == 0 and stats["max_lag"] == 3
    calls = [Call.unpack(blob) for blob in transcript.records]
    tokens, mode = flatten_calls(calls)
    before = sum(tokens["loss_mask"])
    masked = mask_turns(calls, tokens, mode, stats["masked_turns"])
    assert masked == sum(len(c.response_ids) for c in calls[:3]) and sum(tokens["loss_mask"]) == before - masked
    versions_per_token = token_versions(calls, tokens, mode)
    generated = [v for v, m in zip(versions_per_token, [1] * len(versions_per_token)) if v is not None]
    assert set(generated) == {"v1", "v2", "v4"} and len(versions_per_token) == len(tokens["response_ids"])


def test_without_a_fence_nothing_is_masked():
    versions = Versions()
    policy = BumpingPolicy([bash("ls"), submit("done")], versions, [1, 4])
    state: dict = {}
    DefaultAgent(policy, DummySandbox(), AgentConfig(max_turns=10), state=state, timeouts=TIMEOUTS).run(list(TASK))
    assert "staleness" not in state


def test_regenerate_samples_a_stale_new_turn_again_and_counts_it():
    versions = Versions()

    class FrozenAcrossUpdates(BumpingPolicy):
        """The second call's turn comes back sampled at v1 although the trainer is at v3 (a turn
        held across two updates); the regenerated one is at v3."""

        def generate(self, request, should_stop):
            turn = super().generate(request, should_stop)
            if self.calls == 2:
                n = len(turn.response_ids)
                return turn.model_copy(update={"weight_version": "v1",
                                               "weight_segments": [WeightSegment(version="v1", start=0, end=n)]})
            return turn

    policy = FrozenAcrossUpdates([bash("ls"), bash("pwd"), bash("pwd"), submit("done")], versions, [1, 3, 3, 3])
    state, transcript = _run(policy, StalenessFence(versions, 1, "regenerate"))
    stats = state["staleness"]
    assert stats["regenerated_turns"] == 1 and stats["regenerated_tokens"] > 0
    # the first turn (v1, its tool call ran) can only be masked; the regenerated one is fresh
    assert stats["masked_turns"] == [0] and stats["max_lag_kept"] == 0
    assert len(transcript.records) == 3 and policy.calls == 4
