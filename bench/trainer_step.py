"""A GRPO step's wall time split into rollout (the service) and training, with TRL's GRPOTrainer
on SmolLM2-135M on the CPU and every rollout from the service (examples/trl_grpo.py: the live
model is the backend; stem questions, one turn of up to 24 tokens).

    bash scripts/install-trainers.sh trl && python bench/trainer_step.py [--steps 3] [--prompts 1] [--n 4]

``rollout`` is TRL's ``rollout_func`` from call to return: weight version set, one group
submitted per prompt, the service's chains (sandbox, agent loop against the live model, grader)
and the results read back. ``train`` is the rest of the step (TRL's forward and backward passes,
optimizer). Last line: ``rollout_s=<mean> train_s=<mean> rollout_share=<rollout/total>``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples import trl_grpo  # noqa: E402  (sets PRORL_REDIS_URL for the private stack)
from prorl_celery.client import ProrlClient  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=1, help="groups per step")
    parser.add_argument("--n", type=int, default=4, help="samples per group (num_generations)")
    args = parser.parse_args()
    stack = trl_grpo._stack()
    try:
        client = ProrlClient(stack.api_url, token=stack.api_token)
        run = trl_grpo.train(trl_grpo.build(client, steps=args.steps, prompts=args.prompts, n=args.n))
        run.server.stop()
    finally:
        stack.stop()
    tokens = [sum(len(t.prompt_ids) + len(t.response_ids) for t in h["trajectories"]) for h in run.rollout.history]
    print(f"{'step':>4} {'total_s':>8} {'rollout_s':>9} {'train_s':>8} {'tokens':>7} grad_norm")
    for timing, entry, count in zip(run.step_s, trl_grpo.logs(run), tokens):
        print(f"{timing['step']:>4} {timing['total_s']:8.1f} {timing['rollout_s']:9.1f} {timing['train_s']:8.1f} "
              f"{count:7d} {entry['grad_norm']:.4f}")
    rollout = statistics.mean(t["rollout_s"] for t in run.step_s)
    train = statistics.mean(t["train_s"] for t in run.step_s)
    print(f"rollout_s={rollout:.1f} train_s={train:.1f} rollout_share={rollout / (rollout + train):.2f}")


if __name__ == "__main__":
    main()
