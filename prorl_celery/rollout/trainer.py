"""A finished job as the trajectory a trainer consumes, for every trainer's integration alike.

A trainer must never train on a rollout that did not happen: a job that did not complete, or
whose token ids are missing or only approximate (when exact ones are asked for), is an error of
the batch here, not a zero-reward sample made up by the glue.

A harness result whose calls do not chain into one token sequence (``token_mode: segmented``:
context compaction, a sub-agent, an edited history; ``harness.segments``) is never trained on as
if it did. What becomes of it is the trainer's choice (``segmented``), and always counted:

- ``split``: one sample per segment (its own prompt ids, its generated spans at loss mask 1, the
  ids between them at 0, their logprobs; the job's reward on each) — every generated span is
  trained on, in the context it was sampled in. For a trainer that takes any number of samples
  per rollout (:func:`samples`).
- ``drop``: no sample to train on. A trainer whose batch holds one row per prompt (TRL's GRPO, a
  veRL agent loop) keeps the row so that its groups keep their shape, with loss mask 0 on every
  id (it adds no gradient; its reward still counts in its group's baseline) and ``dropped`` set
  (:func:`fixed_row`).
- ``error``: the batch fails (:class:`RolloutFailed`).
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
    segment: int = Field(0, description="Which segment of a segmented harness result this sample is (split).")
    segments: int = Field(1, description="How many segments the job's result had.")
    dropped: str | None = Field(None, description="Why this row is not trained on (loss mask all 0), e.g. "
                                                  "'segmented'; None: it is.")


SEGMENTED = ("split", "drop", "error")


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


def samples(view: dict[str, Any], require_exact: bool = True, segmented: str = "split") -> list[Trajectory]:
    """The training samples of a terminal job: its trajectory, or for a segmented harness result
    what ``segmented`` says (module docstring): one per segment, none, or RolloutFailed."""
    segs = _segments(view, segmented)
    if segs is None:
        return [trajectory(view, require_exact)]
    if segmented == "drop":
        return []
    base = _base(view)
    return [base.model_copy(update={"prompt_ids": seg["prompt_ids"], "response_ids": seg["response_ids"],
                                    "loss_mask": seg["loss_mask"], "logprobs": seg["logprobs"],
                                    "weight_versions": list(seg.get("weight_versions") or []),
                                    "turns": len(seg.get("calls") or []), "segment": k, "segments": len(segs)})
            for k, seg in enumerate(segs)]


def fixed_row(view: dict[str, Any], require_exact: bool = True, segmented: str = "drop") -> Trajectory:
    """One row for a trainer that keeps one per prompt: the trajectory, or for a segmented harness
    result (``segmented``: ``drop`` or ``error``) its first segment's ids at loss mask 0, marked
    ``dropped``."""
    check_segmented(segmented, fixed=True)
    segs = _segments(view, segmented)
    if segs is None:
        return trajectory(view, require_exact)
    first = segs[0]
    return _base(view).model_copy(update={
        "prompt_ids": first["prompt_ids"], "response_ids": first["response_ids"],
        "loss_mask": [0] * len(first["response_ids"]), "logprobs": [0.0] * len(first["response_ids"]),
        "segments": len(segs), "dropped": "segmented"})


def check_segmented(segmented: str, fixed: bool = False) -> None:
    """ValueError unless ``segmented`` is an option (``fixed``: of a trainer with one row per prompt)."""
    allowed = ("drop", "error") if fixed else SEGMENTED
    if segmented not in allowed:
        more = " (split needs a trainer that takes any number of samples)" if fixed and segmented == "split" else ""
        raise ValueError(f"segmented={segmented!r}: one of {', '.join(allowed)}{more}")


def _segments(view: dict[str, Any], segmented: str) -> list[dict[str, Any]] | None:
    """A completed segmented harness result's segments (None: not one); RolloutFailed for ``error``."""
    check_segmented(segmented)
    result = view.get("result") or {}
    if view.get("status") != "completed" or result.get("token_mode") != "segmented":
        return None
    segs = ((result.get("harness") or {}).get("segments")) or []
    if segmented == "error" or not segs:
        raise RolloutFailed(f"job {view.get('job_id', '?')}: token_mode segmented ({len(segs)} segments: "
                            "its calls do not chain into one sequence); segmented='split' trains on each, "
                            "'drop' on none")
    return segs


def _base(view: dict[str, Any]) -> Trajectory:
    """The job's fields of a sample whose ids are set apart (a segment's)."""
    result = view.get("result") or {}
    return Trajectory(job_id=view.get("job_id", "?"), prompt_ids=[], response_ids=[], loss_mask=[], logprobs=[],
                      reward=float(result.get("reward") or 0.0), token_mode="segmented",
                      staleness=result.get("staleness"), messages=result.get("messages") or [],
                      finish_reason=result.get("finish_reason"), resolved=result.get("resolved"),
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


def untrained_by_record(t: Trajectory) -> int:
    """How many ids at loss mask 1 are not a span the gateway recorded the model generating: the
    mask's runs of 1, in order, each must be one assistant message's ``token_ids`` (a message the
    staleness fence masked has no run; a harness's re-sent copy has no ids). A run matched to no
    message — an observation or a template's ids trained on — counts whole. 0 is the only right
    answer. Matched by position in the mask, never by searching for the ids: a model that repeats
    its observation word for word has the same ids inside the observation."""
    spans = [m.get("token_ids") for m in t.messages
             if m.get("role") == "assistant" and not m.get("resent") and m.get("token_ids")]
    runs, start = [], None
    for i, bit in enumerate([*t.loss_mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            runs.append(t.response_ids[start:i])
            start = None
    unmatched, k = 0, 0
    for run in runs:
        at = next((j for j in range(k, len(spans)) if spans[j] == run), None)
        if at is None:
            unmatched += len(run)
        else:
            k = at + 1
    return unmatched
