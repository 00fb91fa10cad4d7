"""Action latency of a sandbox: ``echo hi`` from a worker's point of view, three ways, one run.

- ours: the persistent shell of a bwrap sandbox on a sandbox host, driven over HTTP by handle
  (``RemoteSandbox.exec``), as a stage task does;
- spawn: a new ``bwrap ... bash -c 'echo hi'`` process per command (same namespaces and binds);
- tmux: a tmux session driven by ``send-keys`` and polled with ``capture-pane`` until the output
  appears (the design the reference system moved away from);
- SWE-ReX: the peer a user would pick (``pip install swe-rex``): its ``LocalRuntime`` with one bash
  session (pexpect on a pty, no isolation), called in process, so it pays no HTTP and no sandbox.

Also the time from ``POST /sandboxes`` to a sandbox whose shell answers (cold, handed out by
the warm pool, and cold with ``"network": true``: its own network namespace), and the memory of an idle sandbox (its bwrap, bwrap and bash processes: RSS and
PSS summed).

    python bench/action_latency.py [--n 500] [--creates 40]

Last line: ``action_p50_ms=<> action_p90_ms=<> vs_spawn=<spawn/ours> vs_tmux=<tmux/ours>
vs_swerex=<swerex/ours> create_p50_ms=<cold> create_net_p50_ms=<cold, network> idle_rss_mb=<>``.
"""
from __future__ import annotations

import argparse
import json
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

from sandboxes.base import SandboxHandle  # noqa: E402
from sandboxes.runtimes.bwrap import BwrapConfig, bwrap_argv, bwrap_works, root_entries  # noqa: E402
from sandboxes.client import RemoteSandbox, request  # noqa: E402
from sandboxes.runtimes.procs import child_pids  # noqa: E402

TOKEN = "bench-token"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def start_host(root: str, warm: int) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "sandboxes.host.main", "--no-register", "--token", TOKEN,
            "--runtimes", "bwrap", "--warm", str(warm), "--log-level", "WARNING",
            "--runtime-config", json.dumps({"bwrap": {"root": root}})]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    return proc, proc.stdout.readline().split()[-1]


def create(address: str, job_id: str, network: bool = False) -> RemoteSandbox:
    body = json.dumps({"job_id": job_id, "spec": {"runtime": "bwrap", "network": network}})
    entry = request("POST", address, TOKEN, "/sandboxes", 60, data=body).json()
    return RemoteSandbox(SandboxHandle(host_id=entry["host_id"], address=address, token=TOKEN,
                                       sandbox_id=entry["sandbox_id"], runtime="bwrap"))


def time_calls(call, n: int, warmup: int = 20) -> list[float]:
    for _ in range(warmup):
        call()
    out = []
    for _ in range(n):
        started = time.perf_counter()
        call()
        out.append((time.perf_counter() - started) * 1000)
    return out


def ours(address: str, n: int) -> list[float]:
    box = create(address, "bench-actions")
    try:
        def call() -> None:
            assert box.exec("echo hi").output == "hi\n"
        return time_calls(call, n)
    finally:
        box.close()


def spawn(root: str, n: int) -> list[float]:
    workspace = tempfile.mkdtemp(dir=root)
    os.chmod(workspace, 0o777)
    config = BwrapConfig(shell=["bash", "--noprofile", "--norc", "-c", "echo hi"])
    argv = bwrap_argv(config, workspace_dir=workspace, workdir="/workspace", network=False,
                      root=root_entries(None, config.host_paths),
                      uid=1_999_999 if os.geteuid() == 0 else None)

    def call() -> None:
        assert subprocess.run(argv, capture_output=True, cwd="/").stdout == b"hi\n"
    return time_calls(call, n, warmup=5)


def tmux(n: int) -> tuple[list[float] | None, str]:
    if not shutil.which("tmux"):
        installed = subprocess.run(["apt-get", "install", "-y", "-qq", "tmux"], capture_output=True)
        if installed.returncode != 0 or not shutil.which("tmux"):
            return None, "tmux is not installed and apt-get could not install it"
    session = f"bench{os.getpid()}"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "200", "-y", "50",
                    "bash --noprofile --norc"], check=True)
    counter = iter(range(10**9))

    def call() -> None:
        marker = f"done{next(counter)}"
        subprocess.run(["tmux", "send-keys", "-t", session, f"echo hi; echo {marker}", "Enter"],
                       check=True)
        while True:
            pane = subprocess.run(["tmux", "capture-pane", "-p", "-t", session],
                                  capture_output=True, text=True).stdout
            if f"\n{marker}\n" in f"\n{pane}\n".replace(f"echo {marker}", ""):
                return

    try:
        subprocess.run(["tmux", "send-keys", "-t", session, "clear", "Enter"], check=True)
        return time_calls(call, max(50, n // 5), warmup=5), ""
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def swerex(n: int) -> tuple[list[float] | None, str]:
    """SWE-ReX's local runtime, one bash session, ``echo hi`` per call (in this process)."""
    try:
        from swerex.runtime.abstract import BashAction, CreateBashSessionRequest
        from swerex.runtime.local import LocalRuntime
    except ImportError:
        return None, "swe-rex is not installed (pip install swe-rex)"
    import asyncio

    loop = asyncio.new_event_loop()
    runtime = LocalRuntime()
    loop.run_until_complete(runtime.create_session(CreateBashSessionRequest(startup_timeout=10)))

    def call() -> None:
        obs = loop.run_until_complete(runtime.run_in_session(BashAction(command="echo hi", timeout=10)))
        assert obs.output.strip() == "hi" and obs.exit_code == 0, obs

    try:
        return time_calls(call, n), ""
    finally:
        loop.run_until_complete(runtime.close())
        loop.close()


def creates(address: str, n: int, pause_s: float, network: bool = False) -> list[float]:
    """POST /sandboxes until the sandbox's shell answered (the host answers only then)."""
    out = []
    for i in range(n):
        time.sleep(pause_s)  # lets a warm pool refill, as between rollouts
        started = time.perf_counter()
        box = create(address, f"bench-create-{i}", network)
        out.append((time.perf_counter() - started) * 1000)
        box.close()
    return out


def idle_memory_mb(address: str) -> tuple[float, float]:
    """(RSS, PSS) in MiB of an idle sandbox's processes: outer bwrap, bwrap as pid 1, bash."""
    box = create(address, "bench-idle")
    try:
        box.exec("true")
        pid = box.info()["pid"]
        pids = [pid, *child_pids(pid)]
        pids += [grandchild for child in pids[1:] for grandchild in child_pids(child)]
        rss = pss = 0
        for one in pids:
            with open(f"/proc/{one}/smaps_rollup") as fh:
                for line in fh:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1])
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1])
        return rss / 1024, pss / 1024
    finally:
        box.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500, help="commands per way")
    parser.add_argument("--creates", type=int, default=40)
    args = parser.parse_args()
    if not bwrap_works():
        sys.exit("bubblewrap is missing or cannot create namespaces here")
    root = tempfile.mkdtemp(prefix="bench-action-")
    os.chmod(root, 0o711)
    cold_host, cold = start_host(root, warm=0)
    warm_host, warm = start_host(root, warm=2)
    try:
        mine = ours(cold, args.n)
        spawned = spawn(root, max(50, args.n // 5))
        tmuxed, why = tmux(args.n)
        rexed, rex_why = swerex(args.n)
        cold_creates = creates(cold, args.creates, 0.05)
        net_creates = creates(cold, args.creates, 0.05, network=True)
        creates(warm, 3, 0.3)  # the first request of a kind starts warming it
        warm_creates = creates(warm, args.creates, 0.1)
        rss, pss = idle_memory_mb(cold)
    finally:
        for proc in (cold_host, warm_host):
            proc.terminate()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)
    rows = [("ours: persistent shell via sandbox host (HTTP)", mine),
            ("new bwrap process per command", spawned), ("tmux send-keys + capture-pane", tmuxed),
            ("SWE-ReX local runtime, one bash session", rexed),
            ("create-to-ready, cold", cold_creates), ("create-to-ready, from the warm pool", warm_creates),
            ("create-to-ready, cold, network sandbox", net_creates)]
    for name, values in rows:
        if values is None:
            print(f"{name:<48} skipped: {rex_why if values is rexed else why}")
        else:
            print(f"{name:<48} p50 {pct(values, .5):8.2f} ms   p90 {pct(values, .9):8.2f} ms   n={len(values)}")
    print(f"{'idle sandbox (bwrap, bwrap, bash)':<48} RSS {rss:.1f} MiB   PSS {pss:.1f} MiB")
    p50 = statistics.median(mine)
    vs_tmux = f"{statistics.median(tmuxed) / p50:.0f}" if tmuxed else "skipped"
    vs_rex = f"{statistics.median(rexed) / p50:.1f}" if rexed else "skipped"
    print(f"action_p50_ms={p50:.2f} action_p90_ms={pct(mine, .9):.2f} "
          f"vs_spawn={statistics.median(spawned) / p50:.1f} vs_tmux={vs_tmux} vs_swerex={vs_rex} "
          f"create_p50_ms={statistics.median(cold_creates):.1f} "
          f"create_net_p50_ms={statistics.median(net_creates):.1f} idle_rss_mb={rss:.1f}")


if __name__ == "__main__":
    main()
