"""Asynchronous GRPO through a black-box harness: TRL trains SmolLM2-135M on the CPU on the episodes
of examples/lookup_agent.py, a harness of an ordinary OpenAI client that the service runs in a
sandbox behind its gateway, on the two-turn ``lookup`` task.

    bash scripts/install-trainers.sh trl && bash scripts/install-harnesses.sh openai-client
    python examples/harness_grpo.py --seed 1 --out bench/learning      # 24 steps

Everything but the task and the batch's shape (``SETTINGS`` below) is examples/async_grpo.py's (one step off-policy, keep-mode pauses around
each optimizer step, ``max_staleness`` 1, the curve and the time split). The task: three files
(``notes.txt``, ``codes.txt``, ``todo.txt``, each "the code is NNNNN"), the task naming the one
that holds the code; the harness asks the model which file to open, shows it that file, and asks
for the code (bench/RESULTS.md: why this variant, its base 0.12). The reward follows what the
observation said: a wrong file shows another code. What TRL trains on is the gateway's record of
the two calls, one sequence: the model's two answers at loss mask 1, the observation between them
at 0 (the step log's ``masked_share``); a segmented result would be dropped visibly (``dropped``).
Each step also logs the episodes' median turns.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples import async_grpo  # noqa: E402

FILES = ("notes.txt", "codes.txt", "todo.txt")
HARNESS = Path("/opt/prorl-harnesses/openai-client")
AGENT = {"harness": "command", "max_calls": 2, "wall_s": 600,
         "command": f"{HARNESS / 'bin' / 'python'} {HARNESS / 'lookup_agent.py'}"}
HELDOUT_SEED = 20261206


def instance(prompt: str) -> dict[str, Any]:
    """The task a prompt (a number) stands for: its target file and the three files' codes."""
    rng = random.Random(int(prompt))
    codes = {name: str(rng.randint(10000, 99999)) for name in FILES}
    target = rng.choice(FILES)
    return {"data_source": "lookup", "files": {name: f"the code is {code}\n" for name, code in codes.items()},
            "target": target, "code": codes[target], "agent": AGENT}


def sampling(max_tokens: int) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": 1.0}


def heldout(k: int) -> list[str]:
    rng = random.Random(HELDOUT_SEED)
    return [str(rng.randint(10**8, 10**9 - 1)) for _ in range(k)]


def draw(seed: int, exclude: set[str]) -> async_grpo.Numbers:
    """The run's fresh tasks (9-digit seeds of :func:`instance`), never a held-out one."""
    return async_grpo.Numbers(seed, exclude, 10**8, 10**9 - 1)


LOOKUP = async_grpo.Task("lookup", instance, sampling, heldout, draw, lambda x: f"lookup task {x}")
async_grpo.NAMES["lookup"] = "harness_grpo"

# 4 tasks x 8 samples a step: at a base near 0.1 a group of 8 has unequal rewards twice as often
# as one of 4; 16 tokens a turn (a file's name, a 5-digit code); the held-out pass every 8 steps
# (64 two-call episodes cost about as much as a step)
SETTINGS = async_grpo.Settings(steps=24, groups=4, n=8, max_tokens=16, lr=1e-5, eval_every=8)

if __name__ == "__main__":
    async_grpo.main(LOOKUP, __doc__, SETTINGS)
