"""From the audit's finished jobs to a verdict per task: a policy that earned more than the no-op
agent marks the task hackable; the evidence is what the policy said it did and what the grader saw."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

EPS = 1e-9
TAIL = 1500


class Evidence(BaseModel):
    policy: str
    status: str = Field(description="The job's status: completed, failed ...")
    reward: float | None = Field(None, description="The reward the grader gave (None: no reward, a fault).")
    rewards: dict[str, float] = Field(default_factory=dict, description="Named rewards, where the domain has them.")
    error: str | None = Field(None, description="The error type of a job that did not complete.")
    error_message: str | None = Field(None, description="Its message's tail.")
    wrote: list[str] = Field(default_factory=list, description="The policy's own 'audit:' lines: what it did.")
    grader: dict[str, Any] = Field(default_factory=dict, description="What the grader saw: test exit, output "
                                                                     "tail, tampering flags, the eval block.")
    ran: bool = Field(True, description="Whether the job ran the audit's agent (its result has a harness "
                                        "block); a domain that runs its own agent did not.")


class TaskVerdict(BaseModel):
    task: str
    data_source: str
    hackable: bool
    baseline: float | None = Field(None, description="The no-op agent's reward.")
    policies: list[str] = Field(default_factory=list, description="The policies that earned more than the no-op.")
    evidence: list[Evidence] = Field(default_factory=list, description="Every policy's run, the no-op's first.")
    content_hash: str | None = None
    grader_version: str | None = None
    note: str | None = Field(None, description="Why the task could not be audited (its runs refused at submission).")


def _grader_view(result: dict[str, Any]) -> dict[str, Any]:
    """The part of a result that says what the grader saw, per domain, bounded."""
    harbor = result.get("harbor")
    if isinstance(harbor, dict):
        steps = [{k: (v[-TAIL:] if isinstance(v, str) else v) for k, v in s.items()
                  if k in ("name", "mode", "reward", "test_exit", "output", "tampered", "stopped")}
                 for s in harbor.get("steps") or []]
        return {"steps": steps, "tampered": harbor.get("tampered")}
    view = {}
    for key in ("eval", "integrity", "tests", "test_output"):
        if key in result:
            text = str(result[key])
            view[key] = result[key] if len(text) <= 4 * TAIL else text[-4 * TAIL:]
    return view


def evidence(policy: str, job: dict[str, Any]) -> Evidence:
    """One policy's finished job, as evidence."""
    result = job.get("result") or {}
    output = str((result.get("harness") or {}).get("output") or "")
    wrote = [line[len("audit: "):] for line in output.splitlines() if line.startswith("audit: ")]
    completed = job.get("status") == "completed"
    reward = result.get("reward") if completed else None
    harbor = result.get("harbor") if isinstance(result.get("harbor"), dict) else {}
    return Evidence(policy=policy, status=str(job.get("status")), reward=None if reward is None else float(reward),
                    rewards=dict(harbor.get("rewards") or {}),
                    error=None if completed else (result.get("error") or {}).get("type"),
                    error_message=None if completed else str((result.get("error") or {}).get("message"))[-TAIL:],
                    wrote=wrote[:60], grader=_grader_view(result),
                    ran=not completed or isinstance(result.get("harness"), dict))


def earned_more(run: Evidence, baseline: Evidence) -> bool:
    """A completed run whose reward (or any named reward) beats the baseline's."""
    if run.reward is None:
        return False
    base = baseline.reward or 0.0
    if run.reward > base + EPS:
        return True
    return any(value > baseline.rewards.get(k, 0.0) + EPS for k, value in run.rewards.items())


def judge(task: str, data_source: str, noop: Evidence, runs: list[Evidence]) -> TaskVerdict:
    """Hackable when a policy earned more than the no-op; a task whose domain ran its own agent
    instead of the audit's is not audited (said in ``note``), whatever it earned."""
    if not all(r.ran for r in [noop, *runs]):
        return TaskVerdict(task=task, data_source=data_source, hackable=False, baseline=noop.reward,
                           evidence=[noop, *runs], note="not audited: the domain ran its own agent, not the policies")
    winners = [r.policy for r in runs if earned_more(r, noop)]
    return TaskVerdict(task=task, data_source=data_source, hackable=bool(winners), baseline=noop.reward,
                       policies=winners, evidence=[noop, *runs])
