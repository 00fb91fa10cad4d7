"""TRL's GRPO trains SmolLM2-135M on the CPU with every rollout from the service.

The trainer's live model is served as a ``generate`` backend from this process
(:class:`prorl_celery.integrations.serve.LiveModelServer`); the service runs each rollout (a
sandbox, the agent loop, the grader) against it; TRL trains on the ids, masks and rewards the
service returns (:mod:`prorl_celery.integrations.trl`). One optimizer step per batch, so each
batch's weight version (``step<N>``) is the step that sampled it.

    bash scripts/install-trainers.sh          # torch 2.13.0 (CPU), trl, the model folder
    python examples/trl_grpo.py [--steps 3] [--prompts 1] [--n 4]

It starts a private service (like examples/dapo_dynamic_sampling.py) unless ``--api`` names one
(with ``PRORL_API_TOKEN`` set), and prints per step the reward, the gradient norm and the time
spent in rollouts versus training.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prorl_celery.ops.procs import free_port  # noqa: E402

if "PRORL_REDIS_URL" not in os.environ or __name__ == "__main__":
    os.environ.setdefault("PRORL_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")

from prorl_celery.client import ProrlClient  # noqa: E402
from prorl_celery.integrations.serve import LiveModelServer  # noqa: E402
from prorl_celery.integrations.trl import make_rollout_func, service_reward  # noqa: E402

MODEL_DIR = Path(os.environ.get("PRORL_SMOL_MODEL", Path.home() / ".cache/prorl-celery/smollm2-135m-f32"))
# Two-choice questions: a 135M model names a letter often enough, and the right one sometimes,
# so groups carry a learning signal.
ASK = " Reply with exactly: The answer is A, or: The answer is B."
QUESTIONS = [("Which is larger, 7 or 3?" + ASK, ["7", "3"], "A"), ("Which is an animal?" + ASK, ["table", "dog"], "B"),
             ("Which is a colour?" + ASK, ["blue", "seven"], "A"), ("Which is a fruit?" + ASK, ["chair", "apple"], "B")]
SAMPLING = {"max_turns": 1, "max_tokens": 24, "temperature": 1.0}


def instances() -> dict[str, dict[str, Any]]:
    """TRL's prompt text -> the service's instance (the ``stem`` domain grades the letter)."""
    return {q: {"data_source": "stem", "question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS}


@dataclass
class GrpoRun:
    """What a run leaves for checks and benchmarks."""

    trainer: Any
    rollout: Any
    server: LiveModelServer
    batches: list[dict[str, Any]] = field(default_factory=list)  # what TRL trained on, per step
    step_s: list[dict[str, float]] = field(default_factory=list)
    weights_before: Any = None


def _capture(trainer: Any, run: GrpoRun) -> None:
    """Record the ids and masks TRL builds its loss from (after its own padding), per batch."""
    inner = trainer._generate_and_score_completions

    def wrapped(inputs):
        out = inner(inputs)
        rows = []
        for i in range(out["prompt_ids"].shape[0]):
            prompt = out["prompt_ids"][i][out["prompt_mask"][i].bool()].tolist()
            length = int(out["completion_mask"][i].sum())
            mask = out["tool_mask"][i][:length].tolist() if "tool_mask" in out else [1] * length
            rows.append({"prompt_ids": prompt, "completion_ids": out["completion_ids"][i][:length].tolist(),
                         "mask": [int(m) for m in mask], "job_id": inputs[i].get("prorl_job_id")})
        run.batches.append({"rows": rows, "advantages": out["advantages"].tolist()})
        return out

    trainer._generate_and_score_completions = wrapped


def build(client: ProrlClient, model_dir: Path = MODEL_DIR, steps: int = 3, prompts: int = 1, n: int = 4,
          lr: float = 1e-5, output_dir: str | None = None) -> GrpoRun:
    """The trainer, its rollout func and the live-model backend (registered); nothing trained yet."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    server = LiveModelServer(model, tokenizer, name="smollm2-135m-live").start()
    backend = server.register(client, tokenizer=str(model_dir))
    table = instances()
    rollout = make_rollout_func(client, lambda prompt: table[prompt], tokenizer, sampling_params=SAMPLING,
                                backend_ids=[backend["id"]])
    args = GRPOConfig(output_dir=output_dir or tempfile.mkdtemp(prefix="trl-grpo-"), max_steps=steps,
                      per_device_train_batch_size=prompts * n, num_generations=n, gradient_accumulation_steps=1,
                      learning_rate=lr, beta=0.0, temperature=1.0, logging_steps=1, save_strategy="no",
                      report_to="none", use_vllm=False, use_cpu=True, bf16=False, seed=0,
                      mask_truncated_completions=False, dataloader_num_workers=0,
                      gradient_checkpointing=False)  # 135M: memory is no concern, time is
    data = Dataset.from_dict({"prompt": list(table)})
    trainer = GRPOTrainer(model=model, reward_funcs=service_reward, args=args, train_dataset=data,
                          processing_class=tokenizer, rollout_func=rollout)
    server.model = trainer.model  # the object the optimizer updates
    run = GrpoRun(trainer=trainer, rollout=rollout, server=server)
    run.weights_before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    _capture(trainer, run)
    return run


def train(run: GrpoRun) -> GrpoRun:
    """Train; each step's wall time split into rollout (the service) and the rest (training)."""
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0, self.rollouts = time.monotonic(), len(run.rollout.history)

        def on_step_end(self, args, state, control, **kwargs):
            total = time.monotonic() - self.t0
            rollout = sum(h["rollout_s"] for h in run.rollout.history[self.rollouts:])
            run.step_s.append({"step": state.global_step, "total_s": total, "rollout_s": rollout,
                               "train_s": total - rollout})

    run.trainer.add_callback(Timer())
    run.trainer.train()
    return run


def logs(run: GrpoRun) -> list[dict[str, Any]]:
    return [entry for entry in run.trainer.state.log_history if "grad_norm" in entry]


def _stack():
    from prorl_celery.ops.launcher import Stack, StackOptions

    stack = Stack(StackOptions(state_dir=Path(tempfile.mkdtemp(prefix="trl-grpo-")), persist=False,
                               concurrency={"init": 8, "run": 8, "eval": 8, "maint": 1}))
    stack.start_redis(int(os.environ["PRORL_REDIS_URL"].rsplit(":", 1)[1].split("/")[0]))
    stack.start()
    return stack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=1, help="distinct prompts (groups) per step")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (num_generations)")
    parser.add_argument("--model", type=Path, default=MODEL_DIR, help="a Hugging Face model folder")
    parser.add_argument("--api", default=None, help="a running service (default: start a private one)")
    args = parser.parse_args()
    stack = None if args.api else _stack()
    client = ProrlClient(args.api) if args.api else ProrlClient(stack.api_url, token=stack.api_token)
    try:
        run = train(build(client, args.model, args.steps, args.prompts, args.n))
        for entry, timing, batch in zip(logs(run), run.step_s, run.rollout.history):
            print(f"step {timing['step']}: reward {entry.get('reward', 0):.3f} grad_norm {entry['grad_norm']:.4f} "
                  f"rollout {timing['rollout_s']:.1f}s train {timing['train_s']:.1f}s "
                  f"weights {batch['weight_version']}")
        run.server.stop()
    finally:
        if stack is not None:
            stack.stop()


if __name__ == "__main__":
    main()
