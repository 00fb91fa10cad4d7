"""Per-project quotas: what one project may hold of the fleet at once, set by the operator.

Four quotas, each unset (no limit) by default, kept in the project's record (``keys.projects``,
JSON) where the Redis scripts read them (``cjson``) in the same step that admits:

- ``max_in_flight``: rollouts released to the stages (waiting in the init queue, or in init, run
  or eval); beyond it the project's next job stays pending (:mod:`prorl_celery.fairshare`);
- ``max_sandboxes``: sandboxes its rollouts may hold at once. Each job's *need*, the most it
  holds at once from its init to its end, is worked out at submission from its instance
  (:func:`tasks.handlers.sandbox_need`: 1 for most; a Harbor task 1 + one per compose sidecar
  + 1 for the verifier's fresh sandbox, opened while the agent's lives, unless the operator lets
  the task grade in the agent's own) and stored on the job; the needs of the jobs released or in
  a stage are summed, and the next job stays pending while the sum plus its own need would pass
  the quota. A job whose need alone passes it is
  refused at submission (403 ``policy_denied``, ``field: instance``), whatever ``over`` says
  (one already pending when the quota is lowered below its need waits, held, until the quota
  is raised again or it is cancelled);
- ``max_llm_in_flight``: LLM requests of its rollouts in flight; beyond it a call waits for one to
  finish (:mod:`prorl_celery.llm.routing`);
- ``tokens_per_hour``: prompt and generated tokens of its LLM calls in the last 60 minutes;
  at it, a new call waits until the oldest minute leaves the hour.

``over`` says, per quota, what a *submission* meets while the project is at that quota: ``hold``
(default: accepted, and the jobs wait their turn, ``timings.quota_wait``) or ``429`` (refused
with ``Retry-After`` and a body naming the quota, nothing stored). Either way the quota itself
is enforced where the resource is taken.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

QUOTA_NAMES = ("max_in_flight", "max_sandboxes", "max_llm_in_flight", "tokens_per_hour")
Over = Literal["hold", "429"]


class Quotas(BaseModel):
    """A project's quotas (None: no limit) and what a submission meets beyond each."""

    model_config = ConfigDict(extra="forbid")

    max_in_flight: int | None = Field(None, ge=0, description="Rollouts released to the stages at once.")
    max_sandboxes: int | None = Field(None, ge=0, description="Sandboxes its released rollouts may hold at once "
                                      "(each job's need summed: its own, its sidecars', a separate verifier's).")
    max_llm_in_flight: int | None = Field(None, ge=0, description="LLM requests of its rollouts in flight at once.")
    tokens_per_hour: int | None = Field(None, ge=0, description="Prompt plus generated tokens in the last 60 minutes.")
    over: dict[str, Over] = Field(default_factory=dict, description="Quota name -> hold (default) or 429.")

    def merged(self, changes: dict) -> Quotas:
        """These quotas with ``changes`` applied (a value of 0 or below for a limit: unset it)."""
        data = self.model_dump()
        for name, value in changes.items():
            if name == "over":
                data["over"] = {**data["over"], **value}
            else:
                data[name] = None if value is not None and value < 0 else value
        unknown = set(data["over"]) - set(QUOTA_NAMES)
        if unknown:
            raise ValueError(f"over: unknown quota {sorted(unknown)}; known: {', '.join(QUOTA_NAMES)}")
        return Quotas.model_validate(data)
