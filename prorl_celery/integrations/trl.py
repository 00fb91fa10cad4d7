"""TRL's ``GRPOTrainer`` with rollouts from the service (``pip install torch==2.13.0 trl`` — torch
first and pinned, see scripts/install-trainers.sh).

TRL (1.16) calls ``rollout_func(prompts, trainer)`` with this process's slice of the batch, each
prompt repeated ``num_generations`` times in a row, and wants back, in the same order, one
completion per prompt: ``prompt_ids``, ``completion_ids``, ``logprobs``; every other key is
handed to the reward functions, except ``env_mask``, which TRL uses as the loss mask (1 on
generated ids, 0 on tool observations between turns). Here each run of equal prompts is one
group of the service (its GRPO siblings), and the service's reward reaches TRL through
:func:`service_reward`:

    rollout = make_rollout_func(client, lambda p: {"data_source": "math", ...}, tokenizer,
                                sampling_params={"max_turns": 2, "max_tokens": 64})
    trainer = GRPOTrainer(model=model, reward_funcs=service_reward, args=GRPOConfig(...),
                          train_dataset=data, processing_class=tokenizer, rollout_func=rollout)

Before each batch the backends' weight version is set (``POST /llm_servers/resume``), so every
trajectory says which step's weights sampled it (per token: ``prorl_token_versions``, handed to
the reward functions beside the per-turn ``prorl_weight_versions``); turns fenced by the staleness
bound come with loss mask 0 in ``env_mask``. The batch's results are acknowledged once read
(``POST /jobs/ack``), which is what admission control under ``max_staleness`` waits for.

**Asynchronous** (:func:`make_async_rollout_func`, with :class:`WeightSync` as a TRL callback):
the batch for step k+1 is submitted as soon as step k's batch has been collected, so the service
generates it while TRL trains on step k; around each optimizer step the backends are paused in
keep mode (their turns freeze between two decode steps) and resumed with the new version, and
``max_staleness`` bounds how old a result may be.

**Segmented harness results** (calls that do not chain into one sequence): TRL keeps one row per
prompt, so ``segmented="drop"`` (the default) keeps the row with loss mask 0 on every id — it adds
no gradient, its reward stays in its group's baseline — and ``"error"`` fails the batch; each
batch's ``history`` entry counts the rows dropped and why (``dropped``), the reward functions get
``prorl_dropped`` per row, and a warning is logged. Nothing is trained on as if it were one
sequence (:mod:`prorl_celery.rollout.trainer`). The rollout func draws its prompts itself
(``draw(n_groups)``): TRL's own prompts for a step are only known when that step starts, one
step too late; the ids TRL trains on are the ones returned, so only their number is used.
"""
from __future__ import annotations

import collections
import itertools
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from prorl_celery.client import ProrlClient
from prorl_celery.rollout.trainer import RolloutFailed, Trajectory, check_segmented, fixed_row

log = logging.getLogger(__name__)
InstanceBuilder = Callable[[Any], dict[str, Any]]
REWARD_KEY = "prorl_reward"


def service_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """A TRL reward function: the reward the service gave each rollout (set by the rollout func)."""
    rewards = kwargs.get(REWARD_KEY)
    if rewards is None:
        raise RolloutFailed("no service rewards in the batch: is rollout_func the one make_rollout_func made?")
    return [float(r) for r in rewards]


service_reward.__name__ = "prorl_service"  # the name TRL logs the reward under


def runs(prompts: list[Any]) -> list[tuple[Any, int]]:
    """Consecutive equal prompts as (prompt, count): TRL's num_generations copies of each."""
    return [(prompt, len(list(same))) for prompt, same in itertools.groupby(prompts)]


class RolloutFunc:
    """The ``rollout_func`` TRL calls; :attr:`history` keeps each batch's trajectories (job ids,
    versions, timings) for whoever wants to check or log them."""

    def __init__(self, client: ProrlClient, instance_builder: InstanceBuilder, tokenizer: Any = None,
                 sampling_params: dict[str, Any] | None = None, backend_ids: list[str] | None = None,
                 weight_version: Callable[[int], str] | None = None, timeout: float = 1800.0,
                 require_exact: bool = True, keep_history: bool = True, segmented: str = "drop"):
        check_segmented(segmented, fixed=True)  # drop or error: refused here, not mid-run
        self.client, self.build, self.timeout, self.segmented = client, instance_builder, timeout, segmented
        self.backend_ids, self.require_exact, self.keep_history = backend_ids, require_exact, keep_history
        self.version_of = weight_version or (lambda step: f"step{step}")
        self.sampling_params = {"token_level_generation": True, **(sampling_params or {})}
        name = getattr(tokenizer, "name_or_path", None)
        if name and "tokenizer" not in self.sampling_params:
            self.sampling_params["tokenizer"] = name  # the service renders with the trainer's own template
        self.history: list[dict[str, Any]] = []

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list]:
        step = int(getattr(getattr(trainer, "state", None), "global_step", 0) or 0)
        version = self.version_of(step)
        started = time.monotonic()
        self.client.resume(ids=self.backend_ids, weight_version=version)
        job_ids = self._submit(prompts)
        trajectories = self._collect(job_ids)
        if self.keep_history:
            self.history.append({"step": step, "weight_version": version, "trajectories": trajectories,
                                 "rollout_s": time.monotonic() - started, "dropped": dropped(trajectories)})
        return to_trl(trajectories)

    def _submit(self, prompts: list[Any]) -> list[str]:
        job_ids: list[str] = []
        for prompt, n in runs(prompts):
            _, ids = self.client.submit_group(self.build(prompt), n=n, sampling_params=self.sampling_params)
            job_ids += ids
        return job_ids

    def _collect(self, job_ids: list[str]) -> list[Trajectory]:
        views = {view["job_id"]: view for view in self.client.as_completed(job_ids, timeout=self.timeout)}
        self.client.ack(job_ids)  # consumed: they stop holding back admission (max_staleness)
        rows = [fixed_row(views[job_id], self.require_exact, self.segmented) for job_id in job_ids]
        lost = dropped(rows)
        if lost:
            log.warning("%d of %d rows not trained on (loss mask 0): %s", sum(lost.values()), len(rows), lost)
        return rows


def dropped(rows: list[Trajectory]) -> dict[str, int]:
    """How many rows of a batch are not trained on, by reason."""
    return dict(collections.Counter(row.dropped for row in rows if row.dropped))


def to_trl(trajectories: list[Trajectory]) -> dict[str, list]:
    """TRL's rollout_func output: the required keys, ``env_mask`` (the loss mask) and the extra
    fields the reward functions receive."""
    return {"prompt_ids": [t.prompt_ids for t in trajectories],
            "completion_ids": [t.response_ids for t in trajectories],
            "logprobs": [t.logprobs for t in trajectories],
            "env_mask": [t.loss_mask for t in trajectories],
            REWARD_KEY: [t.reward for t in trajectories],
            "prorl_job_id": [t.job_id for t in trajectories],
            "prorl_weight_versions": [t.weight_versions for t in trajectories],
            "prorl_token_versions": [t.token_versions for t in trajectories],
            "prorl_dropped": [t.dropped for t in trajectories]}


def make_rollout_func(client: ProrlClient, instance_builder: InstanceBuilder, tokenizer: Any = None,
                      **options: Any) -> RolloutFunc:
    """A ``rollout_func`` for ``GRPOTrainer``: ``instance_builder`` turns one of TRL's prompts (a
    string or a message list, as in the dataset) into the service's instance; ``tokenizer`` is the
    trainer's, whose name or folder the service renders prompts with. Options: see RolloutFunc."""
    return RolloutFunc(client, instance_builder, tokenizer, **options)


class AsyncRolloutFunc(RolloutFunc):
    """One step off-policy: each call returns the batch submitted at the previous call (waiting
    for what is not done yet) and submits the next one before TRL trains. ``draw(k)`` returns k
    instances' prompts (one per group); ``max_staleness`` goes into every job's sampling set.
    Each :attr:`history` entry also has ``wait_s`` (the trainer blocked on the batch) and the
    batch's version lags (:func:`lags`)."""

    def __init__(self, client: ProrlClient, instance_builder: InstanceBuilder, draw: Callable[[int], list[Any]],
                 tokenizer: Any = None, max_staleness: int | None = 1, **options: Any):
        super().__init__(client, instance_builder, tokenizer, **options)
        self.draw = draw
        if max_staleness is not None:
            self.sampling_params["max_staleness"] = max_staleness
        self.pending: dict[str, Any] | None = None

    def _submit_next(self, groups: int, n: int) -> dict[str, Any]:
        job_ids: list[str] = []
        for prompt in self.draw(groups):  # one group each, even if two draws are equal
            job_ids += self.client.submit_group(self.build(prompt), n=n, sampling_params=self.sampling_params)[1]
        return {"job_ids": job_ids, "submitted": time.monotonic()}

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list]:
        step = int(getattr(getattr(trainer, "state", None), "global_step", 0) or 0)
        n = int(trainer.args.num_generations)  # TRL's prompts come n copies in a row
        started = time.monotonic()
        if self.pending is None:  # the first step: nothing was generated ahead
            self.pending = self._submit_next(len(prompts) // n, n)
        batch, trajectories = self.pending, self._collect(self.pending["job_ids"])
        waited = time.monotonic() - started
        self.pending = self._submit_next(len(prompts) // n, n)  # generated while TRL trains on this one
        if self.keep_history:
            self.history.append({"step": step, "trajectories": trajectories, "wait_s": waited,
                                 "rollout_s": time.monotonic() - batch["submitted"], "lags": lags(trajectories, step),
                                 "dropped": dropped(trajectories)})
        return to_trl(trajectories)

    def close(self) -> None:
        """Cancel and acknowledge the batch submitted for a step that will not come."""
        if self.pending is not None:
            for job_id in self.pending["job_ids"]:
                try:
                    self.client.cancel(job_id)
                except Exception:  # noqa: BLE001 - already finished
                    pass
            self.client.ack(self.pending["job_ids"])
            self.pending = None


_STEP = re.compile(r"^step(\d+)$")


def lags(trajectories: list[Trajectory], step: int) -> dict[str, float]:
    """How many optimizer steps behind the weights training at ``step`` each generated token's
    weights were (versions named ``step<N>``): mean, max, and the share of tokens one or more behind."""
    found = [step - int(m.group(1)) for t in trajectories for v in (t.token_versions or [])
             if v and (m := _STEP.match(v))]
    if not found:
        return {"mean": 0.0, "max": 0, "stale_share": 0.0, "tokens": 0}
    stale = sum(1 for x in found if x > 0)
    return {"mean": sum(found) / len(found), "max": max(found), "stale_share": stale / len(found), "tokens": len(found)}


class WeightSync:
    """The callbacks that keep the backends in step with the weights (a ``transformers``
    ``TrainerCallback`` is built around it by :func:`weight_sync_callback`): pause in keep mode
    right before each optimizer step (the served turns freeze between decode steps), resume with
    ``step<N+1>`` right after it. :attr:`pauses` holds per step the pause call's seconds and how
    long the backends stood still."""

    def __init__(self, client: ProrlClient, backend_ids: list[str] | None = None, mode: str = "keep"):
        self.client, self.ids, self.mode = client, backend_ids, mode
        self.pauses: list[dict[str, Any]] = []
        self._t0 = 0.0
        self._answer: dict[str, Any] = {}

    def before_step(self, step: int) -> None:
        self._t0 = time.monotonic()
        self._answer = self.client.pause(self.mode, ids=self.ids)
        if not self._answer.get("safe", False):
            raise RolloutFailed(f"pause did not make the weights safe to write: {self._answer}")

    def after_step(self, step: int) -> str:
        version = f"step{step + 1}"
        self.client.resume(ids=self.ids, weight_version=version)
        self.pauses.append({"step": step, "pause_call_s": float(self._answer.get("pause_s", 0.0)),
                            "frozen_s": time.monotonic() - self._t0, "modes": self._answer.get("modes"),
                            "version": version})
        return version


def weight_sync_callback(sync: WeightSync) -> Any:
    """``sync`` as a TrainerCallback (pause before, resume after each optimizer step)."""
    from transformers import TrainerCallback

    class _WeightSync(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            sync.before_step(state.global_step)

        def on_optimizer_step(self, args, state, control, **kwargs):
            sync.after_step(state.global_step)

    return _WeightSync()


def make_async_rollout_func(client: ProrlClient, instance_builder: InstanceBuilder, draw: Callable[[int], list[Any]],
                            tokenizer: Any = None, max_staleness: int | None = 1, **options: Any) -> AsyncRolloutFunc:
    """An asynchronous ``rollout_func`` (see the module docstring); pair it with
    ``weight_sync_callback(WeightSync(client, backend_ids))`` on the trainer."""
    return AsyncRolloutFunc(client, instance_builder, draw, tokenizer, max_staleness=max_staleness, **options)
