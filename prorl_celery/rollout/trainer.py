"""A finished job as the trajectory a trainer consumes, for every trainer's integration alike.

A trainer must never train on a rollout that did not happen: a job that did not complete, or
whose token ids are missing or only approximate (when exact ones are asked for), is an error of
the batch here, not a zero-reward sample made up by the glue.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from prorl_celery.errors import RolloutFailed


class Trajectory(BaseModel):
    """One job's tokens, reward and provenance (see prorl_celery/rollout/trajectory.py for the ids)."""

    job_id: str
    prompt_ids: list[int]
    response_ids: list[int] = Field(description="Every id after the prompt: generated (mask 1) and added (mask 0).")
    loss_mask: list[int]
    logprobs: list[float] = Field(description="The sampled ids' logprobs; 0.0 where the mask is 0.")
    reward: float
    token_mode: str = Field(description="exact, retokenized or none.")
    turns: int = 0
    weight_versions: list[str | None] = Field(default_factory=list, description="Each assistant turn's.")
    token_versions: list[str | None] | None = Field(
        None, description="One per response id: the weight version that sampled it (None: ids the prompts added); "
                          "a turn that spanned an update has tokens of each version. None if not exact.")
    staleness: dict[str, Any] | None = Field(None, description="The staleness bound's counts (masked turns, "
                                                               "regenerated turns and tokens, lags).")
    messages: list[dict[str, Any]] = Field(default_factory=list)
    finish_reason: str | None = None
    resolved: bool | None = None
    timing: dict[str, Any] = Field(default_factory=dict)
    job_timings: dict[str, Any] = Field(default_factory=dict, description="The job's stage seconds (queue, init, "
                                                                         "run, eval, total, llm).")


def trajectory(view: dict[str, Any], require_exact: bool = True) -> Trajectory:
    """The trajectory of a terminal job record (``GET /jobs/<id>``); raises RolloutFailed when the
    job did not complete or its ids are not fit to train on."""
    result = _fit_to_train(view, require_exact)
    tokens, messages = result["tokens"], result.get("messages") or []
    return Trajectory(job_id=view.get("job_id", "?"), prompt_ids=tokens["prompt_ids"],
                      response_ids=tokens["response_ids"], loss_mask=tokens["loss_mask"], logprobs=tokens["logprobs"],
                      reward=float(result.get("reward") or 0.0), token_mode=result["token_mode"],
                      turns=result.get("turns") or 0,
                      weight_versions=[m.get("weight_version") for m in messages if m.get("role") == "assistant"],
                      token_versions=result.get("token_versions"), staleness=result.get("staleness"),
                      messages=messages, finish_reason=result.get("finish_reason"), resolved=result.get("resolved"),
                      timing=result.get("timing") or {}, job_timings=view.get("timings") or {})


def _fit_to_train(view: dict[str, Any], require_exact: bool) -> dict[str, Any]:
    """The job's result, if the job completed with ids fit to train on; else RolloutFailed."""
    job_id = view.get("job_id", "?")
    result = view.get("result") or {}
    if view.get("status") != "completed":
        raise RolloutFailed(f"job {job_id} ended {view.get('status')}: {result.get('error') or result.get('status')}")
    tokens = result.get("tokens") or {}
    mode = result.get("token_mode") or "none"
    if mode == "none" or not tokens.get("response_ids"):
        raise RolloutFailed(f"job {job_id} has no token ids (token_mode {mode}): register the backend with the "
                            "generate protocol, or a chat server that returns token ids")
    if require_exact and mode != "exact":
        raise RolloutFailed(f"job {job_id}: token_mode {mode}, not exact")
    return result
