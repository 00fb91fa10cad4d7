"""Harbor task folders: what an image costs to build and to find built, what a sample's sandbox
costs to start on a built image, and what grading apart from the agent costs beyond the task's
own test — measured side by side in one run on the real stack.

1. Builds, into a fresh image directory: the Debian base (mmdebstrap, once per node), then each
   example task's image (``examples/harbor``) on it, then each again (found built: the cached call).
2. Samples: the stack with that image directory; each task run ``--samples`` times by the oracle
   (its solve.sh), one at a time so the figures are the pipeline's, not a queue's. Per sample:
   the init stage (a cached start: the image found, the writable sandbox opened, the step's files
   put in place), and the verifier's overhead per graded step: its grading's seconds less the
   test's own (``harbor.steps[].grade_s - test_s``) — the artifacts and the carried tar taken, the
   fresh sandbox, /tests, the reward files watched (0.3 s) and read after the kill.

    python bench/harbor.py [--samples 8] [--tasks hello,scores,stages,wordcount]

Last line: ``base_build_s=<> image_build_s=<mean> cached_lookup_ms=<mean> init_p50_s=<>
verifier_overhead_p50_s=<> verifier_overhead_p90_s=<>``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
EXAMPLES = REPO / "examples" / "harbor"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def builds(tasks: list[str], root: Path) -> dict[str, float]:
    """Seconds of the base, of each task's image on it, and of each found built."""
    from sandboxes.runtimes.images import bases
    from sandboxes.runtimes.images.build import ensure_built
    from tasks.harbor.boxes import from_only
    from tasks.harbor.task import read

    started = time.monotonic()
    base = bases.resolve("debian:bookworm", time.monotonic() + 900)
    bases.ensure_debian(base, root, time.monotonic() + 900)
    out = {"base": time.monotonic() - started}
    contexts = {}
    for name in tasks:
        task = read(EXAMPLES / name)
        dockerfile = task.environment / "Dockerfile"
        contexts[name] = task.environment if dockerfile.is_file() else from_only(task.config.environment.docker_image)
    for name, context in contexts.items():
        started = time.monotonic()
        ensure_built(context, timeout_s=900, root=root)
        out[f"build:{name}"] = time.monotonic() - started
    for name, context in contexts.items():
        started = time.monotonic()
        ensure_built(context, timeout_s=900, root=root)
        out[f"cached:{name}"] = time.monotonic() - started
    return out


def samples(tasks: list[str], n: int, root: Path) -> dict[str, list[tuple[float, float]]]:
    """Per task, (init stage s, verifier overhead s) of each oracle sample."""
    from prorl_celery.client import ProrlClient
    from prorl_celery.ops.launcher import Stack, StackOptions

    env = {"PRORL_IMAGE_BUILD_DIR": str(root), "PRORL_HARBOR_TASK_DIRS": str(EXAMPLES)}
    options = StackOptions(state_dir=Path(tempfile.mkdtemp(prefix="bench-harbor-")),
                           concurrency={"init": 2, "run": 2, "eval": 2, "maint": 1}, env=env)
    stack = Stack(options)
    os.environ["PRORL_API_TOKEN"] = stack.api_token
    out: dict[str, list[tuple[float, float]]] = {}
    with stack:
        client = ProrlClient(stack.api_url, timeout=300)
        for name in tasks:
            rows = out.setdefault(name, [])
            for _ in range(n):
                job = client.submit({"data_source": "harbor", "task_dir": str(EXAMPLES / name),
                                     "agent": {"harness": "oracle"}})
                view = client.wait(job, timeout=900, poll_s=30)
                result = view["result"]
                if view["status"] != "completed" or result["reward"] != 1.0:
                    raise SystemExit(f"{name}: the oracle did not earn 1: {str(result)[:2000]}")
                steps = result["harbor"]["steps"]  # each graded as it ended: grade_s, of which test_s is the test's
                rows.append((view["timings"]["init"],
                             sum(s["grade_s"] - s["test_s"] for s in steps) / len(steps)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tasks", default="hello,scores,stages,wordcount")
    args = parser.parse_args()
    tasks = args.tasks.split(",")
    root = Path(tempfile.mkdtemp(prefix="bench-harbor-images-", dir="/var/tmp"))
    root.chmod(0o711)
    try:
        built = builds(tasks, root)
        runs = samples(tasks, args.samples, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average {os.getloadavg()}")
    print(f"{'task':<12}{'build s':>9}{'cached ms':>11}{'init p50 s':>12}{'verifier overhead p50/p90 s':>30}")
    inits, overheads = [], []
    for name in tasks:
        init = [r[0] for r in runs[name]]
        over = [r[1] for r in runs[name]]
        inits += init
        overheads += over
        print(f"{name:<12}{built['build:' + name]:>9.1f}{built['cached:' + name] * 1000:>11.1f}"
              f"{statistics.median(init):>12.2f}{statistics.median(over):>18.2f} / {pct(over, 0.9):.2f}")
    image_build = statistics.mean(built[f"build:{t}"] for t in tasks)
    cached = statistics.mean(built[f"cached:{t}"] for t in tasks) * 1000
    print(f"base_build_s={built['base']:.1f} image_build_s={image_build:.1f} cached_lookup_ms={cached:.1f} "
          f"init_p50_s={statistics.median(inits):.2f} verifier_overhead_p50_s={statistics.median(overheads):.2f} "
          f"verifier_overhead_p90_s={pct(overheads, 0.9):.2f}")


if __name__ == "__main__":
    main()
