"""veRL's agent loop with rollouts from the service: ``@register("prorl")`` (veRL 0.9.1,
``verl.experimental.agent_loop``; ``pip install torch==2.13.0`` first, then ``verl``).

veRL's rollout worker instantiates an agent loop per sample and awaits ``run(sampling_params,
**dataset_fields)``; this one submits the sample to the service, waits for it, and returns the
service's trajectory as veRL's ``AgentLoopOutput`` (``prompt_ids``, ``response_ids``,
``response_mask`` from the loss mask, ``response_logprobs``, ``reward_score`` from the service's
grader, ``num_turns``, metrics from its timings). veRL's own ``server_manager`` is not used: the
service calls the inference servers, so register veRL's rollout servers with it
(``POST /llm_servers``) and set the weight version after each weight sync (``POST
/llm_servers/resume {"weight_version"}``). Select it with ``agent_name: prorl`` in the dataset,
or ``actor_rollout_ref.rollout.agent.default_agent_loop=prorl``; examples/verl_agent_loop.yaml
sets the service's address through ``agent_loop_config_path``.

A segmented harness result (calls that do not chain into one sequence) is one sample here too:
``segmented: drop`` (default) returns it with response mask 0 on every id and
``extra_fields.prorl_dropped``, ``error`` fails it (:mod:`prorl_celery.rollout.trainer`).

The instance comes from the dataset row: an ``instance`` field, else ``extra_info.instance``,
else a math instance from the last user message and ``reward_model.ground_truth``.
"""
from __future__ import annotations

import asyncio
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

from prorl_celery.client import ProrlClient
from prorl_celery.rollout.trainer import RolloutFailed, Trajectory, check_segmented, fixed_row


def instance_from_row(row: dict[str, Any]) -> dict[str, Any]:
    """The service instance of one veRL dataset row (see the module docstring for the order)."""
    if isinstance(row.get("instance"), dict):
        return dict(row["instance"])
    extra = row.get("extra_info") or {}
    if isinstance(extra, dict) and isinstance(extra.get("instance"), dict):
        return dict(extra["instance"])
    messages = list(row.get("raw_prompt") or [])
    user = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), None)
    truth = (row.get("reward_model") or {}).get("ground_truth")
    if user is None or truth is None:
        raise RolloutFailed("the row has no instance, extra_info.instance, or user prompt with "
                            "reward_model.ground_truth to build one from")
    return {"data_source": row.get("data_source") or "math", "problem": user, "answer": str(truth)}


def service_sampling(sampling_params: dict[str, Any], response_length: int | None,
                     defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """veRL's sampling params in the service's names: token mode, veRL's response length as the
    per-turn cap (``defaults`` — e.g. ``max_turns`` — first, veRL's values over them)."""
    out = {"token_level_generation": True, **(defaults or {})}
    for key in ("temperature", "top_p", "top_k", "repetition_penalty", "seed"):
        if sampling_params.get(key) is not None:
            out[key] = sampling_params[key]
    if response_length and "max_tokens" not in out:
        out["max_tokens"] = int(response_length)
    return out


def to_output(traj: Trajectory, response_length: int | None = None) -> AgentLoopOutput:
    """veRL's output of one trajectory; the response cut to veRL's ``response_length`` (its padding)."""
    cut = slice(0, response_length) if response_length else slice(None)
    timing = traj.timing or {}
    turns = sum(1 for m in traj.messages if m.get("role") != "system")
    metrics = AgentLoopMetrics(generate_sequences=float(timing.get("llm") or 0.0),
                               tool_calls=float(timing.get("actions") or 0.0),
                               compute_score=float(timing.get("eval") or 0.0))
    return AgentLoopOutput(prompt_ids=traj.prompt_ids, response_ids=traj.response_ids[cut],
                           response_mask=traj.loss_mask[cut], response_logprobs=traj.logprobs[cut],
                           reward_score=traj.reward, num_turns=turns or 2 * traj.turns, metrics=metrics,
                           extra_fields={"prorl_job_id": traj.job_id, "token_mode": traj.token_mode,
                                         "weight_versions": traj.weight_versions, "resolved": traj.resolved,
                                         "token_versions": traj.token_versions[cut] if traj.token_versions else None,
                                         "staleness": traj.staleness,
                                         "finish_reason": traj.finish_reason, "assistant_turns": traj.turns,
                                         "turn_scores": [], "tool_rewards": [], "prorl_dropped": traj.dropped})


@register("prorl")
class ProrlAgentLoop(AgentLoopBase):
    """Runs the sample as a job of the service. Extra keyword arguments (from the agent loop
    config file): ``prorl_url``, ``prorl_token``, ``prorl_state_dir`` (else ``PRORL_API_URL``,
    ``PRORL_API_TOKEN``, ``PRORL_STATE_DIR``), ``sampling`` (service defaults such as
    ``max_turns``), ``timeout`` (seconds per rollout), ``require_exact`` (token ids), ``segmented``
    (drop or error: a segmented harness result)."""

    def __init__(self, *args: Any, prorl_url: str | None = None, prorl_token: str | None = None,
                 prorl_state_dir: str | None = None, sampling: dict[str, Any] | None = None,
                 timeout: float = 3600.0, require_exact: bool = True, segmented: str = "drop", **kwargs: Any):
        super().__init__(*args, **kwargs)
        check_segmented(segmented, fixed=True)  # drop or error: refused here
        self.segmented = segmented
        self.client = ProrlClient(prorl_url, token=prorl_token, state_dir=prorl_state_dir)
        self.defaults = dict(sampling or {})
        self.timeout, self.require_exact = timeout, require_exact
        self.response_length = getattr(self.rollout_config, "response_length", None)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        instance = instance_from_row(kwargs)
        params = service_sampling(sampling_params, self.response_length, self.defaults)
        view = await asyncio.to_thread(self._rollout, instance, params)
        return to_output(fixed_row(view, self.require_exact, self.segmented), self.response_length)

    def _rollout(self, instance: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        job_id = self.client.submit(instance, sampling_params=params)
        return self.client.wait(job_id, timeout=self.timeout)
