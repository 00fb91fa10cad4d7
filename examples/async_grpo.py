"""Asynchronous GRPO through the service: TRL trains SmolLM2-135M on the CPU while the service
generates the next batch from the live weights, paused in keep mode around every optimizer step.

    bash scripts/install-trainers.sh trl      # torch 2.13.0 (CPU), trl, matplotlib, the model folder
    python examples/async_grpo.py --steps 40 --seed 1 --out bench/learning

The task is the ``echo`` domain (tasks/handlers/echo.py): "Repeat this 5-digit number exactly:
NNNNN", rewarded when the reply says the number back (``match: contains``), one assistant turn,
no tools. Why this one: sampled at temperature 1.0 the model says the number back about a third
of the time (and the tool-using variants not at all: it never calls ``submit``), so a group of
four usually has unequal rewards — a learning signal — and a step is short enough for the CPU.

Each step: the batch generated during the previous step is collected (8 prompts x 4 samples),
its results acknowledged, the next batch submitted (``max_staleness`` 1), then TRL takes one
optimizer step (DAPO loss, no KL) with the backend paused (keep) around the weight write and
resumed as ``step<N+1>``. Every ``--eval-every`` steps (and at the start and the end) 64 fixed
held-out prompts are sampled once each (temperature 1.0, batched). Per step it prints and writes
(``<out>/async_grpo_seed<S>.json``) the reward, held-out accuracy, the tokens' staleness (steps
behind the weights they are trained at), the pause, and where the time went: waiting for the
batch, training, the engine's decoding, the service's own time per rollout (stage time outside
the model); and draws ``<out>/async_grpo_seed<S>.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prorl_celery.ops.procs import free_port  # noqa: E402

if "PRORL_REDIS_URL" not in os.environ or __name__ == "__main__":
    os.environ.setdefault("PRORL_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")

from prorl_celery.client import ProrlClient  # noqa: E402
from prorl_celery.integrations.serve import LiveModelServer  # noqa: E402
from prorl_celery.integrations.trl import (WeightSync, make_async_rollout_func, service_reward,  # noqa: E402
                                           weight_sync_callback)
from prorl_celery.rollout.trainer import untrained_by_record  # noqa: E402

MODEL_DIR = Path(os.environ.get("PRORL_SMOL_MODEL", Path.home() / ".cache/prorl-celery/smollm2-135m-f32"))
HELDOUT_SEED = 20261202  # the 64 held-out numbers are the same for every run


@dataclass
class Settings:
    steps: int = 40
    seed: int = 1
    groups: int = 8
    n: int = 4
    max_tokens: int = 32
    lr: float = 5e-6
    eval_every: int = 5
    heldout: int = 64
    max_staleness: int = 1
    out: Path = ROOT / "bench" / "learning"


def instance(number: str) -> dict[str, Any]:
    return {"data_source": "echo", "text": number, "match": "contains", "tools": "none"}


def sampling(max_tokens: int) -> dict[str, Any]:
    return {"max_turns": 1, "max_tokens": max_tokens, "temperature": 1.0}


def heldout_numbers(k: int) -> list[str]:
    rng = random.Random(HELDOUT_SEED)
    return [str(rng.randint(10000, 99999)) for _ in range(k)]


class Numbers:
    """The training prompts: fresh numbers in [lo, hi] (5 digits unless told) from the run's seed,
    never a held-out one."""

    def __init__(self, seed: int, exclude: set[str], lo: int = 10000, hi: int = 99999):
        self.rng, self.exclude, self.lo, self.hi = random.Random(seed), exclude, lo, hi

    def __call__(self, k: int) -> list[str]:
        out: list[str] = []
        while len(out) < k:
            x = str(self.rng.randint(self.lo, self.hi))
            if x not in self.exclude:
                out.append(x)
        return out


@dataclass(frozen=True)
class Task:
    """What is trained on: a prompt (a string the draw makes) as the service's instance, the run's
    fresh prompts, the held-out ones, the sampling set. examples/harness_grpo.py has another."""

    name: str
    instance: Callable[[str], dict[str, Any]]
    sampling: Callable[[int], dict[str, Any]]
    heldout: Callable[[int], list[str]]
    draw: Callable[[int, set[str]], Callable[[int], list[str]]]  # (seed, held-out) -> draw(k)
    text: Callable[[str], str] = str  # a prompt as TRL's dataset holds it (only the batch's shape is used)


ECHO = Task("echo", instance, sampling, heldout_numbers, Numbers, lambda x: f"Repeat this 5-digit number exactly: {x}")


@dataclass
class Run:
    settings: Settings
    trainer: Any
    rollout: Any
    server: LiveModelServer
    sync: WeightSync
    client: ProrlClient
    steps: list[dict[str, Any]] = field(default_factory=list)
    heldout: dict[int, dict[str, Any]] = field(default_factory=dict)  # step -> accuracy, seconds
    started: float = field(default_factory=time.monotonic)
    unconsumed_after: int = -1  # results admitted under the bound but never acknowledged, at the end
    task: Task = ECHO


def evaluate(client: ProrlClient, numbers: list[str], max_tokens: int, model_dir: Path,
             task: Task = ECHO) -> dict[str, Any]:
    """Held-out sampled accuracy: each prompt once at temperature 1.0 (no staleness bound: these
    are never trained on), all submitted at once so the server decodes them together."""
    started = time.monotonic()
    params = {**task.sampling(max_tokens), "token_level_generation": True, "tokenizer": str(model_dir)}
    ids = client.submit_many([{"instance": task.instance(x), "sampling_params": params} for x in numbers])
    views = list(client.as_completed(ids, timeout=1800))
    client.ack(ids)
    rewards = [float((v.get("result") or {}).get("reward") or 0.0) for v in views]
    return {"accuracy": sum(rewards) / len(rewards), "seconds": time.monotonic() - started,
            "failed": sum(1 for v in views if v["status"] != "completed")}


def build(client: ProrlClient, settings: Settings, model_dir: Path = MODEL_DIR, task: Task = ECHO) -> Run:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    rows = settings.groups * settings.n + settings.heldout  # a training batch and a held-out pass
    server = LiveModelServer(model, tokenizer, name="smollm2-135m-live", max_batch=rows).start()
    backend = server.register(client, tokenizer=str(model_dir), weight_version="step0", capacity=rows)
    held = task.heldout(settings.heldout)
    draw = task.draw(settings.seed, set(held))
    rollout = make_async_rollout_func(client, task.instance, draw, tokenizer, max_staleness=settings.max_staleness,
                                      sampling_params=task.sampling(settings.max_tokens), backend_ids=[backend["id"]])
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="async-grpo-"), max_steps=settings.steps,
                      per_device_train_batch_size=settings.groups * settings.n, num_generations=settings.n,
                      gradient_accumulation_steps=1, learning_rate=settings.lr, lr_scheduler_type="constant",
                      beta=0.0, loss_type="dapo",
                      temperature=1.0, max_completion_length=settings.max_tokens, logging_steps=1,
                      save_strategy="no", report_to="none", use_vllm=False, use_cpu=True, bf16=False,
                      seed=settings.seed, mask_truncated_completions=False, dataloader_num_workers=0,
                      gradient_checkpointing=False)
    # TRL's own prompts only set the batch's shape: the rollout func draws its own (one step ahead)
    data = Dataset.from_dict({"prompt": [task.text(x) for x in draw(64)]})
    trainer = GRPOTrainer(model=model, reward_funcs=service_reward, args=args, train_dataset=data,
                          processing_class=tokenizer, rollout_func=rollout)
    server.model = trainer.model  # the object the optimizer updates
    sync = WeightSync(client, [backend["id"]], mode="keep")
    trainer.add_callback(weight_sync_callback(sync))
    return Run(settings, trainer, rollout, server, sync, client, task=task)


def _engine_s(server: LiveModelServer, since: float, until: float) -> tuple[float, int]:
    """Seconds the engine spent decoding, and rows it decoded, in batches that ended in [since, until]."""
    got = [b for b in list(server.engine.batches) if since <= b["ended"] <= until]
    return sum(b["seconds"] for b in got), sum(b["rows"] for b in got)


def train(run: Run, model_dir: Path = MODEL_DIR, log=print) -> Run:
    from transformers import TrainerCallback

    held = run.task.heldout(run.settings.heldout)
    s = run.settings

    def heldout(step: int) -> None:
        run.heldout[step] = evaluate(run.client, held, s.max_tokens, model_dir, run.task)
        log(f"  held-out at step {step}: accuracy {run.heldout[step]['accuracy']:.3f} "
            f"({run.heldout[step]['seconds']:.1f}s)")

    class StepLog(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.monotonic()

        def on_step_end(self, args, state, control, **kwargs):
            end = time.monotonic()
            batch = run.rollout.history[-1]
            pause = run.sync.pauses[-1]
            trajs = batch["trajectories"]
            unmatched = [untrained_by_record(t) for t in trajs]  # 0 for each, or the check failed
            llm = [float(t.job_timings.get("llm") or t.timing.get("llm") or 0.0) for t in trajs]
            service = [max(0.0, float(t.job_timings.get("total", 0.0)) - m) for t, m in zip(trajs, llm)]
            gen_s, rows = _engine_s(run.server, self.t0, end)
            total = end - self.t0
            record = {"step": state.global_step, "reward": sum(t.reward for t in trajs) / len(trajs),
                      "total_s": total, "wait_s": batch["wait_s"], "train_s": total - batch["wait_s"],
                      "pause_call_s": pause["pause_call_s"], "frozen_s": pause["frozen_s"],
                      "engine_s": gen_s, "engine_rows": rows, "batch_rollout_s": batch["rollout_s"],
                      "service_s": sum(service) / len(service), "llm_s": sum(llm) / len(llm),
                      "lag_mean": batch["lags"]["mean"], "lag_max": batch["lags"]["max"],
                      "stale_share": batch["lags"]["stale_share"],
                      "tokens": sum(sum(t.loss_mask) for t in trajs), "load1": os.getloadavg()[0],
                      "turns": sorted(t.turns for t in trajs)[len(trajs) // 2],
                      "masked_share": (sum(len(t.loss_mask) - sum(t.loss_mask) for t in trajs)
                                       / max(1, sum(len(t.loss_mask) for t in trajs))),
                      "dropped": batch.get("dropped") or {},
                      "observation_mask_ones": sum(unmatched),
                      # what to look at where the check finds any: the job, its calls' messages
                      "mask_suspects": [{"job_id": t.job_id, "ones": ones,
                                         "assistant": [{"ids": len(m.get("token_ids") or []),
                                                        "resent": bool(m.get("resent")),
                                                        "content": str(m.get("content"))[:80]}
                                                       for m in t.messages if m.get("role") == "assistant"],
                                         "mask_ones": sum(t.loss_mask), "response": len(t.response_ids)}
                                        for t, ones in zip(trajs, unmatched) if ones],
                      "elapsed_s": end - run.started, "modes": sorted(set((pause["modes"] or {}).values()))}
            run.steps.append(record)
            log(f"step {record['step']:3d}: reward {record['reward']:.3f} | wait {record['wait_s']:5.1f}s "
                f"train {record['train_s']:5.1f}s (pause {record['pause_call_s']:.2f}s, "
                f"frozen {record['frozen_s']:.2f}s) "
                f"| engine {gen_s:5.1f}s/{rows} rows, service {record['service_s']:.1f}s/rollout, "
                f"llm {record['llm_s']:.1f}s/rollout | lag {record['lag_mean']:.2f} (max {record['lag_max']}) "
                f"| load {record['load1']:.1f}")
            if state.global_step % s.eval_every == 0 or state.global_step == s.steps:
                heldout(state.global_step)

    heldout(0)
    run.trainer.add_callback(StepLog())
    try:
        run.trainer.train()
    finally:
        run.rollout.close()
    deadline = time.monotonic() + 60  # the cancelled batch's jobs are consumed as they end
    while True:
        run.unconsumed_after = int(run.client.weights().get("unconsumed", -1))
        if run.unconsumed_after == 0 or time.monotonic() > deadline:
            return run
        time.sleep(1)


def summary(run: Run) -> dict[str, Any]:
    rewards = [r["reward"] for r in run.steps]
    first, last = rewards[:5], rewards[-5:]
    steps = sorted(run.heldout)
    before, after = run.heldout[steps[0]]["accuracy"], run.heldout[steps[-1]]["accuracy"]
    out = {"seed": run.settings.seed, "steps": len(run.steps), "first5": sum(first) / len(first),
           "last5": sum(last) / len(last), "heldout_before": before, "heldout_after": after,
           "minutes": (time.monotonic() - run.started) / 60,
           "mean_step_s": {k: sum(r[k] for r in run.steps) / len(run.steps)
                           for k in ("total_s", "wait_s", "train_s", "pause_call_s", "frozen_s", "engine_s",
                                     "service_s", "llm_s")},
           "lag_mean": sum(r["lag_mean"] for r in run.steps) / len(run.steps),
           "turns_median": sorted(r["turns"] for r in run.steps)[len(run.steps) // 2],
           "masked_share_mean": sum(r["masked_share"] for r in run.steps) / len(run.steps),
           "observation_mask_ones": sum(r.get("observation_mask_ones", 0) for r in run.steps),
           "dropped": sum(sum((r.get("dropped") or {}).values()) for r in run.steps),
           "lag_max": max(r["lag_max"] for r in run.steps),
           "load1_mean": sum(r["load1"] for r in run.steps) / len(run.steps)}
    out["unconsumed_after"] = run.unconsumed_after
    out["goal_reward"] = out["last5"] >= out["first5"] + 0.3
    out["goal_heldout"] = after >= before + 0.2
    return out


def plot(run: Run, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in run.steps]
    fig, (a, b, d, c) = plt.subplots(4, 1, figsize=(8, 11.5), sharex=True)
    a.plot(steps, [r["reward"] for r in run.steps], label=f"batch mean reward ({run.settings.groups} x {run.settings.n} samples)")
    hs = sorted(run.heldout)
    a.plot(hs, [run.heldout[h]["accuracy"] for h in hs], "o-", label=f"held-out sampled accuracy ({run.settings.heldout} prompts)")
    a.set_ylim(0, 1.05)
    a.set_ylabel("reward / accuracy")
    a.legend(loc="lower right", fontsize=8)
    a.set_title(f"async GRPO through the service, SmolLM2-135M, {run.task.name} (seed {run.settings.seed})")
    b.plot(steps, [r["lag_mean"] for r in run.steps], label="mean token lag (steps)")
    b.plot(steps, [r["stale_share"] for r in run.steps], label="share of tokens >= 1 step old")
    b.set_ylabel("staleness")
    b.set_ylim(0, 1.05)
    b.legend(loc="center left", fontsize=8)
    pause = b.twinx()
    pause.plot(steps, [r["frozen_s"] * 1000 for r in run.steps], "k:", label="pause (keep) to resume, ms")
    pause.plot(steps, [r["pause_call_s"] * 1000 for r in run.steps], "k--", label="pause call until safe, ms")
    pause.set_ylabel("pause (ms)")
    pause.set_ylim(0, None)
    pause.legend(loc="center right", fontsize=8)
    d.plot(steps, [r["turns"] for r in run.steps], label="generated turns per episode (median)")
    d.set_ylabel("turns")
    d.set_ylim(0, max(r["turns"] for r in run.steps) + 1)
    d.legend(loc="center left", fontsize=8)
    share = d.twinx()
    share.plot(steps, [r["masked_share"] for r in run.steps], "g--", label="share of ids at loss mask 0")
    share.set_ylim(0, 1.05)
    share.set_ylabel("masked share")
    share.legend(loc="center right", fontsize=8)
    c.stackplot(steps, [r["wait_s"] for r in run.steps], [r["train_s"] for r in run.steps],
                labels=["waiting for the batch", "training (incl. pause)"], alpha=0.6)
    c.plot(steps, [r["engine_s"] for r in run.steps], label="engine decoding in the step")
    c.plot(steps, [r["service_s"] for r in run.steps], label="service time per rollout (outside the model)")
    c.set_ylabel("seconds")
    c.set_xlabel("optimizer step")
    c.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write(run: Run, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    result = {"summary": summary(run), "steps": run.steps,
              "heldout": {str(k): v for k, v in sorted(run.heldout.items())},
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(run.settings).items()}}
    name = f"{NAMES.get(run.task.name, run.task.name + '_grpo')}_seed{run.settings.seed}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    plot(run, out / f"{name}.png")
    return result


NAMES = {"echo": "async_grpo"}  # a task's files: <name>_seed<S>.json / .png


def _stack():
    from prorl_celery.ops.launcher import Stack, StackOptions

    # the workers import this checkout's code (the domain), like this process
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    # room for a training batch (32) and a held-out pass (64) at once, each rollout in its sandbox
    stack = Stack(StackOptions(state_dir=Path(tempfile.mkdtemp(prefix="async-grpo-")), persist=False,
                               concurrency={"init": 16, "run": 100, "eval": 16, "maint": 1},
                               env={"PRORL_SANDBOX_CAPACITY": "128"}))
    stack.start_redis(int(os.environ["PRORL_REDIS_URL"].rsplit(":", 1)[1].split("/")[0]))
    stack.start()
    return stack


def main(task: Task = ECHO, doc: str | None = None, defaults: Settings | None = None) -> None:
    parser = argparse.ArgumentParser(description=(doc or __doc__).splitlines()[0])
    defaults = defaults or Settings()
    for name, value in vars(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--model", type=Path, default=MODEL_DIR, help="a Hugging Face model folder")
    parser.add_argument("--api", default=None, help="a running service (default: start a private one)")
    args = parser.parse_args()
    settings = Settings(**{k: getattr(args, k) for k in vars(defaults)})
    stack = None if args.api else _stack()
    client = ProrlClient(args.api) if args.api else ProrlClient(stack.api_url, token=stack.api_token)
    try:
        run = train(build(client, settings, args.model, task), args.model)
        result = write(run, settings.out)
        print(json.dumps(result["summary"], indent=1))
        run.server.stop()
    finally:
        if stack is not None:
            stack.stop()


if __name__ == "__main__":
    main()
