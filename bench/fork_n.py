"""Init once, fork n: a GRPO group of ``--n`` samples of one SWE-style Harbor task, prepared once
and forked (tasks/harbor/fork.py) against ``--n`` independent setups (``"fork": false``),
measured side by side in one run on the real stack.

The task (written to a temporary folder): an image with git, Python and pip; its step's
``setup.sh`` does what a SWE environment's does: a git repository of ``--files`` source files
committed, and a package installed offline from the step's files (``pip install --no-index``).
Each sample's agent sleeps, so that all ``--n`` sandboxes are alive when the disk is measured.

Per mode: the seconds from the group's submission until every sample's sandbox is ready (all
left init: image found, sandbox open, files and setup in place, healthcheck passed), and the
disk the prepared state takes once all are ready (each sandbox's overlay upper directory, plus
the group's frozen layer).

    python bench/fork_n.py [--n 8] [--files 3000] [--rounds 1]

Last line: ``ready_independent_s=<> ready_fork_s=<> speedup=<> disk_independent_mb=<> disk_fork_mb=<>``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DOCKERFILE = """FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends git python3 python3-pip python3-setuptools \\
    && rm -rf /var/lib/apt/lists/*
WORKDIR /repo
"""
TOML = """schema_version = "1.1"

[task]
name = "bench/swe-setup"

[environment]
workdir = "/repo"
memory_mb = 2048
storage_mb = 4096

[[steps]]
name = "main"

[steps.healthcheck]
command = "git -C /repo rev-parse HEAD && python3 -c 'import benchpkg'"
interval_sec = 0.2
timeout_sec = 10
retries = 2
"""
SETUP = """set -e
python3 - <<'PY'
import os, random
random.seed(7)
for i in range({files}):
    d = f"src/mod{{i % 50:02d}}"
    os.makedirs(d, exist_ok=True)
    with open(f"{{d}}/file{{i:05d}}.py", "w") as fh:
        fh.write("".join(f"def f{{j}}(x):\\n    return x * {{random.randint(1, 10**6)}} + {{j}}\\n\\n" for j in range(40)))
PY
git init -q . && git config user.email bench@example.org && git config user.name bench
git add -A && git commit -qm "the task's base commit" && git gc -q  # packed, as a clone's objects are
pip install -q --no-index --no-build-isolation --break-system-packages ./pkg
rm -rf ./pkg
"""
PKG_SETUP = "from setuptools import setup\nsetup(name='benchpkg', version='1.0', packages=['benchpkg'])\n"
TEST = "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n"


def make_task(root: Path, files: int) -> Path:
    task = root / "swe-setup"
    step = task / "steps" / "main"
    for path in (task / "environment", step / "workdir" / "pkg" / "benchpkg", step / "tests"):
        path.mkdir(parents=True)
    (task / "environment" / "Dockerfile").write_text(DOCKERFILE)
    (task / "task.toml").write_text(TOML)
    (step / "instruction.md").write_text("Fix the bug.\n")
    (step / "workdir" / "setup.sh").write_text(SETUP.format(files=files))
    (step / "workdir" / "pkg" / "setup.py").write_text(PKG_SETUP)
    for i in range(30):
        (step / "workdir" / "pkg" / "benchpkg" / f"m{i}.py").write_text(f"VALUE = {i}\n" * 200)
    (step / "workdir" / "pkg" / "benchpkg" / "__init__.py").write_text("from .m0 import VALUE\n")
    (step / "tests" / "test.sh").write_text(TEST)
    return task


def disk_kb(host_pid: int, sandbox_root: Path, layer_root: Path | None) -> int:
    """The overlay upper directories of the live sandboxes (read in the host's own mount
    namespace, where their workspace filesystems are mounted), and the frozen layers."""
    script = f"du -skc {sandbox_root}/*/bwrap-*/upper {layer_root or ''} 2>/dev/null | tail -1"
    out = subprocess.run(["nsenter", "-t", str(host_pid), "-m", "--", "sh", "-c", script],
                         capture_output=True, text=True)
    return int(out.stdout.split()[0]) if out.stdout.strip() else 0


def run_group(client, task: Path, n: int, fork: bool, hold_s: float, host_pid: int, sandbox_root: Path,
              layer_root: Path) -> dict:
    instance = {"data_source": "harbor", "task_dir": str(task), "fork": fork,
                "agent": {"harness": "command", "command": f"sleep {hold_s}"}}
    started = time.monotonic()
    _, jobs = client.submit_group(instance, n)
    ready_at = None
    while ready_at is None:
        views = [client.get(job) for job in jobs]
        failed = [v for v in views if v["status"] in ("failed", "cancelled", "timeout")]
        if failed:
            raise SystemExit(f"a sample failed: {str(failed[0].get('result'))[:3000]}")
        if all(v["status"] not in ("queued", "init") for v in views):
            ready_at = time.monotonic() - started
        else:
            time.sleep(0.1)
    disk = disk_kb(host_pid, sandbox_root, layer_root if fork else None)
    views = [client.wait(job, timeout=900, poll_s=30) for job in jobs]
    forks = [v["result"]["harbor"].get("fork") or {} for v in views]
    inits = [v["timings"]["init"] for v in views]
    return {"ready_s": ready_at, "disk_mb": disk / 1024, "init_p50_s": statistics.median(inits),
            "prepare_s": max((f.get("prepare_s") or 0.0) for f in forks),
            "freeze_s": max((f.get("freeze_s") or 0.0) for f in forks),
            "layer_mb": max((f.get("bytes") or 0) for f in forks) / 2**20,
            "from": sorted({str(f.get("from", f.get("off"))) for f in forks})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    from prorl_celery.client import ProrlClient
    from prorl_celery.ops.launcher import Stack, StackOptions
    import redis

    from sandboxes.client import live_hosts
    from sandboxes.runtimes.images.build import ensure_built

    top = Path(tempfile.mkdtemp(prefix="bench-fork-n-", dir="/var/tmp"))
    top.chmod(0o711)
    task = make_task(top / "tasks", args.files)
    sandbox_root, layer_root = top / "sandboxes", top / "layers"
    started = time.monotonic()
    ensure_built(task / "environment", timeout_s=1800)
    print(f"image built (or found) in {time.monotonic() - started:.1f} s")
    env = {"PRORL_HARBOR_TASK_DIRS": str(top / "tasks"), "PRORL_SANDBOX_ROOT": str(sandbox_root),
           "PRORL_SANDBOX_LAYER_DIR": str(layer_root)}
    options = StackOptions(state_dir=top / "state", concurrency={"init": args.n, "run": args.n, "eval": 2, "maint": 1},
                           env=env)
    stack = Stack(options)
    os.environ["PRORL_API_TOKEN"] = stack.api_token
    rows: dict[str, list[dict]] = {"independent": [], "fork": []}
    try:
        with stack:
            client = ProrlClient(stack.api_url, timeout=300)
            host_pid = live_hosts(redis.Redis.from_url(stack.redis_url))[0].pid
            for _ in range(args.rounds):
                for mode in ("independent", "fork"):
                    rows[mode].append(run_group(client, task, args.n, mode == "fork", 20.0, host_pid, sandbox_root,
                                                   layer_root))
                    print(mode, rows[mode][-1], flush=True)
                    time.sleep(3)  # the sweep removes the group's layer
    finally:
        shutil.rmtree(top, ignore_errors=True)
    load = os.getloadavg()
    ready = {mode: statistics.median(r["ready_s"] for r in rs) for mode, rs in rows.items()}
    disk = {mode: statistics.median(r["disk_mb"] for r in rs) for mode, rs in rows.items()}
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'mode':<13}{'all ready s':>12}{'init p50 s':>12}{'setup s':>9}{'disk MB':>9}")
    for mode, rs in rows.items():
        print(f"{mode:<13}{ready[mode]:>12.2f}{statistics.median(r['init_p50_s'] for r in rs):>12.2f}"
              f"{statistics.median(r['prepare_s'] for r in rs):>9.2f}{disk[mode]:>9.1f}")
    print(f"ready_independent_s={ready['independent']:.2f} ready_fork_s={ready['fork']:.2f} "
          f"speedup={ready['independent'] / ready['fork']:.1f} disk_independent_mb={disk['independent']:.1f} "
          f"disk_fork_mb={disk['fork']:.1f}")


if __name__ == "__main__":
    main()
