"""How many threads each worker gets and how many sandboxes a host serves.

Stage workers use Celery's thread pool: a thread in ``run`` holds one rollout, which waits on its
inference server and its sandbox, not on the CPU. So the run worker is sized to the sandboxes the
node can hold, and init and eval (which start sandboxes and run graders) to a fraction of that.
Where a number comes from, first match wins: an explicit override (``up --concurrency``),
``PRORL_QUEUE_CONCURRENCY`` (per queue), ``PRORL_WORKER_CONCURRENCY`` (every stage queue, when
set), else derived from ``PRORL_SANDBOX_CAPACITY``.

    python -m prorl_celery.ops.sizing [--cpus N] [--shell]

prints the plan (``--shell``: as ``NAME=value`` lines for the Slurm scripts).
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Mapping

from pydantic import BaseModel, Field

from config.settings import Settings, get_settings

QUEUES = ("init", "run", "eval", "maint")
STAGE_QUEUES = ("init", "run", "eval")
# what one idle in-flight rollout costs a node besides its own processes (measured: bench/scale.py)
NODE_MB_PER_SANDBOX = 16


class SizingError(ValueError):
    """A ``--concurrency`` value that names no queue or is not a positive number."""


class Plan(BaseModel):
    """Threads per queue and the sandbox capacity, with where each number came from."""

    concurrency: dict[str, int] = Field(description="Queue -> threads of its worker.")
    source: dict[str, str] = Field(description="Queue -> which setting decided it.")
    sandbox_capacity: int = Field(description="Sandboxes one host serves at once.")

    def line(self) -> str:
        return " ".join(f"{q}={n} ({self.source[q]})" for q, n in self.concurrency.items())


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def derived(capacity: int) -> dict[str, int]:
    """From the sandbox capacity: run holds one rollout per sandbox; init and eval a quarter of
    that (8 to 64 threads: sandbox starts and graders are short next to a rollout)."""
    side = _clamp(capacity // 4, 8, 64)
    return {"init": side, "run": max(1, capacity), "eval": side, "maint": 2}


def parse_concurrency(text: str) -> dict[str, int]:
    """``"run=1050,init=64"`` -> ``{"run": 1050, "init": 64}``; SizingError names a bad part."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        queue, sep, value = part.partition("=")
        if not sep or queue not in QUEUES:
            raise SizingError(f"{part!r}: expected QUEUE=THREADS with QUEUE one of {', '.join(QUEUES)}")
        if not value.isdigit() or int(value) < 1:
            raise SizingError(f"{part!r}: the thread count must be a positive integer")
        out[queue] = int(value)
    return out


def settings_with(env: Mapping[str, str]) -> Settings:
    """The settings as a child started with ``env`` on top of this environment will read them."""
    values: dict = {}
    for key, value in env.items():
        name = key.removeprefix("PRORL_").lower()
        if key.startswith("PRORL_") and name in Settings.model_fields:
            values[name] = json.loads(value) if value[:1] in "{[" else value
    return Settings(**values) if values else get_settings()


def plan(settings: Settings | None = None, overrides: Mapping[str, int] | None = None) -> Plan:
    settings = settings or get_settings()
    concurrency = derived(settings.sandbox_capacity)
    source = {q: f"sandbox_capacity={settings.sandbox_capacity}" for q in concurrency}
    layers = [({q: settings.worker_concurrency for q in STAGE_QUEUES}
               if "worker_concurrency" in settings.model_fields_set else {}, "worker_concurrency"),
              (settings.queue_concurrency, "queue_concurrency"), (overrides or {}, "--concurrency")]
    for values, name in layers:
        for queue, threads in values.items():
            concurrency[queue], source[queue] = int(threads), name
    return Plan(concurrency=concurrency, source=source, sandbox_capacity=settings.sandbox_capacity)


def node_capacity(cpus: int, available_mb: int) -> int:
    """Sandboxes a node can hold by default: 32 per CPU (rollouts mostly wait on inference),
    at most what its available memory holds at NODE_MB_PER_SANDBOX each."""
    return max(1, min(32 * cpus, available_mb // NODE_MB_PER_SANDBOX))


def available_mb() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 4096


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prorl_celery.ops.sizing", description=__doc__.splitlines()[0])
    parser.add_argument("--cpus", type=int, default=None, help="size the sandbox capacity from these CPUs "
                        "and this node's memory unless PRORL_SANDBOX_CAPACITY is set")
    parser.add_argument("--shell", action="store_true", help="print NAME=value lines")
    args = parser.parse_args(argv)
    settings = get_settings()
    if args.cpus and "sandbox_capacity" not in settings.model_fields_set:
        settings = settings.model_copy(update={"sandbox_capacity": node_capacity(args.cpus, available_mb())})
    result = plan(settings)
    if not args.shell:
        print(f"sandbox_capacity={result.sandbox_capacity} {result.line()}")
        return 0
    print(f"CAPACITY={result.sandbox_capacity}")
    for queue, threads in result.concurrency.items():
        print(f"{queue.upper()}_CONCURRENCY={threads}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
