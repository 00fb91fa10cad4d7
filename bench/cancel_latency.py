"""Time from a cancel to the typed ``cancelled`` result and the sandbox being gone, for many
running rollouts: one by one (``DELETE /jobs/<id>``) or all at once (``POST /cancel_all``).

Starts the service and puts N rollouts in their run stage, each a sandbox shell inside a long
``sleep`` (found in /proc under the sandbox's pid before anything is cancelled).

Default: they are cancelled one after another while they all run. For each, from just before the
DELETE until (a) the API answered with the typed ``cancelled`` result and (b) the sandbox's shell
process no longer exists.

``--bulk``: one ``POST /cancel_all`` while all N run. Per job, from just before the POST until
(a) its typed result is in the store (the Redis time of its completion-stream entry, which the
same script writes with the result) and (b) every process of its sandbox has exited (the process
tree under the sandbox's pid as /proc shows it before the cancel, each watched by a pidfd). A
job's latency is the later of the two. Afterwards /proc is scanned again for the sleeps.
The default runtime is bwrap, what a node serves where it works: its close (pid namespace,
cgroup, loop-mounted workspace, uid lease) is what a cancel really costs; ``local`` only kills
a process group.

    python bench/cancel_latency.py [--jobs 100]
    python bench/cancel_latency.py --bulk --jobs 1000 [--runtime bwrap|local]

Last line: ``cancel_p50_ms=<> cancel_p99_ms=<>`` (time until the sandbox is gone), or with
``--bulk`` ``bulk_cancel n=<> answered_ms=<> p50_ms=<> p99_ms=<> left_sandboxes=<>``.
"""
from __future__ import annotations

import argparse
import os
import random
import resource
import select
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.private import REDIS_PASSWORD, REDIS_PORT  # noqa: E402  (sets the environment)

import requests  # noqa: E402

from bench.scale import cpu_s  # noqa: E402
from prorl_celery import keys  # noqa: E402
from prorl_celery.connections import get_store  # noqa: E402
from prorl_celery.jobs import JobStore  # noqa: E402
from prorl_celery.ops.launcher import Stack, StackOptions  # noqa: E402
from prorl_celery.models import JobResult  # noqa: E402
from prorl_celery.status import JobStatus  # noqa: E402
from sandboxes.client import list_sandboxes  # noqa: E402
from sandboxes.runtimes.procs import alive, proc_stats  # noqa: E402

SLEEP_S = 1500  # longer than the bring-up of 1,000 rollouts on a loaded node


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# -- /proc -----------------------------------------------------------------------------------
def proc_table() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, command line) of every process /proc shows now."""
    return {pid: (int(fields[1]), argv) for pid, fields, argv in proc_stats(cmdline=True)}


def subtrees(table: dict[int, tuple[int, bytes]], roots: dict[str, list[int]]) -> dict[str, list[int]]:
    """Job -> its roots and every descendant of them in ``table``."""
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (ppid, _) in table.items():
        children[ppid].append(pid)
    out: dict[str, list[int]] = {}
    for job_id, todo in roots.items():
        found: list[int] = []
        todo = [pid for pid in todo if pid in table]
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo.extend(children.get(pid, ()))
        out[job_id] = found
    return out


def marked(table: dict[int, tuple[int, bytes]], marker: bytes) -> set[int]:
    return {pid for pid, (_, cmdline) in table.items() if cmdline == marker}


# -- the rollouts ----------------------------------------------------------------------------
def sandbox_roots(store: JobStore, ids: list[str]) -> dict[str, list[int]]:
    """Job -> the pids its sandbox's host names for it (the sandbox's pid, its network helper's)."""
    records = [r for r in store.get_many(ids) if r is not None and r.sandbox]
    by_host = {(r.sandbox["address"], r.sandbox["token"]) for r in records}
    entries = {e.sandbox_id: e for address, token in by_host for e in list_sandboxes(address, token)}
    roots: dict[str, list[int]] = {}
    for record in records:
        entry = entries.get(record.sandbox["sandbox_id"])
        if entry is not None:
            roots[record.job_id] = [p for p in (entry.pid, entry.info.get("net_pid")) if p]
    return roots


def start_sleepers(http: requests.Session, api: str, n: int, runtime: str, marker: list[str],
                   timeout_s: float) -> tuple[list[str], dict[str, list[int]]]:
    """Submit ``n`` shell rollouts and wait until each one's sandbox runs the ``marker`` sleep (or
    the rollout ended without: a sandbox start that failed under load); returns the ids of those
    in their sleep and, per job, its sandbox's processes (from /proc)."""
    command = " ".join(marker)
    jobs = [{"instance": {"data_source": "shell", "commands": [command], "timeout": SLEEP_S + 60,
                          "sandbox": {"runtime": runtime}}} for _ in range(n)]
    ids = http.post(f"{api}/jobs", json={"jobs": jobs}, timeout=300).json()["job_ids"]
    store, want = get_store(), "\0".join(marker).encode() + b"\0"
    deadline, last = time.monotonic() + timeout_s, None
    while True:
        table = proc_table()
        sleeping = len(marked(table, want))
        ended = {r.job_id for r in store.get_many(ids) if r is not None and r.status.terminal}
        if (sleeping, len(ended)) != last:
            print(f"  {time.strftime('%H:%M:%S')} sleeping {sleeping}/{n}, ended {len(ended)}, in run "
                  f"{len(store.ids_in(JobStatus.RUN))}, load {os.getloadavg()[0]:.1f}", flush=True)
            last = (sleeping, len(ended))
        if sleeping + len(ended) >= n:
            live = [i for i in ids if i not in ended]
            trees = subtrees(table, sandbox_roots(store, live))
            if sum(1 for t in trees.values() if marked({p: table[p] for p in t}, want)) == len(live):
                return live, trees
        assert time.monotonic() < deadline, f"only {sleeping} of {n} rollouts reached their sleep"
        time.sleep(2.0)


class ExitWatch(threading.Thread):
    """When each job's last watched process exited (unix time), told by pidfds: an exited
    process's pidfd turns readable, and a pid reused meanwhile cannot fool it."""

    def __init__(self, trees: dict[str, list[int]]):
        super().__init__(daemon=True)
        self.job_of: dict[int, str] = {}
        self.pending: dict[str, int] = defaultdict(int)
        self.gone_at: dict[str, float] = {}
        self.stop = threading.Event()
        for job_id, pids in trees.items():
            for pid in pids:
                try:
                    fd = os.pidfd_open(pid)
                except ProcessLookupError:
                    continue
                self.job_of[fd] = job_id
                self.pending[job_id] += 1

    def run(self) -> None:
        poller = select.poll()
        for fd in self.job_of:
            poller.register(fd, select.POLLIN)
        while self.job_of and not self.stop.is_set():
            events = poller.poll(100)
            now = time.time()
            for fd, _ in events:
                poller.unregister(fd)
                os.close(fd)
                job_id = self.job_of.pop(fd)
                self.pending[job_id] -= 1
                if not self.pending[job_id]:
                    self.gone_at[job_id] = now

    def left(self) -> dict[str, int]:
        return {job_id: count for job_id, count in self.pending.items() if count}


def stored_at(store: JobStore, t0: float, ids: list[str], timeout_s: float) -> dict[str, float]:
    """Job -> unix time its terminal result was stored: the Redis-clock id of its entry in the
    completion stream, added by the script that stores the result."""
    wanted, found = set(ids), {}
    deadline = time.monotonic() + timeout_s
    while len(found) < len(wanted) and time.monotonic() < deadline:
        for entry_id, fields in store.redis.xrange(keys.completions(), min=f"{int(t0 * 1000)}-0"):
            job_id = fields[b"job_id"].decode()
            if job_id in wanted:
                found.setdefault(job_id, int(entry_id.split(b"-")[0]) / 1000)
        time.sleep(0.2)
    return found


def typed_cancelled(store: JobStore, ids: list[str]) -> int:
    """How many of ``ids`` are ``cancelled`` with a result that validates as a typed one."""
    count = 0
    for record in store.get_many(ids):
        if record is None or record.status is not JobStatus.CANCELLED or not record.result:
            continue
        result = JobResult.model_validate(record.result)
        count += result.status is JobStatus.CANCELLED and result.critical_error == "cancelled"
    return count


def _ms(values: list[float]) -> str:
    return f"p50 {statistics.median(values):8.1f} ms  p99 {percentile(values, 0.99):8.1f} ms  max {max(values):8.1f} ms"


def bulk(stack: Stack, http: requests.Session, n: int, runtime: str) -> None:
    marker = ["sleep", f"{SLEEP_S}.{random.randrange(10**6):06d}"]  # this run's sleeps, nobody else's
    ids, trees = start_sleepers(http, stack.api_url, n, runtime, marker, timeout_s=1800)
    store, submitted, n = get_store(), n, len(ids)
    print(f"{n} of {submitted} rollouts in run ({submitted - n} failed to start), "
          f"{sum(map(len, trees.values()))} sandbox processes; load {os.getloadavg()[0]:.1f}", flush=True)
    watch = ExitWatch(trees)
    watch.start()
    cpu_before = cpu_s(stack)
    t0 = time.time()
    body = http.post(f"{stack.api_url}/cancel_all", json={}, timeout=600).json()
    answered = (time.time() - t0) * 1000
    stored = stored_at(store, t0, ids, timeout_s=60)
    watch.join(timeout=60)
    watch.stop.set()
    cpu = {k: v - cpu_before.get(k, 0.0) for k, v in cpu_s(stack).items()}
    leftover = marked(proc_table(), "\0".join(marker).encode() + b"\0")
    listed = sum(len(list_sandboxes(h["address"], h["token"])) for h in
                 {(r.sandbox["address"], r.sandbox["token"]): r.sandbox
                  for r in store.get_many(ids) if r and r.sandbox}.values())
    typed = typed_cancelled(store, ids)
    result_ms = [(stored[i] - t0) * 1000 for i in ids if i in stored]
    gone_ms = [(watch.gone_at[i] - t0) * 1000 for i in ids if i in watch.gone_at]
    both = [max(stored[i], watch.gone_at[i]) * 1000 - t0 * 1000 for i in ids
            if i in stored and i in watch.gone_at]
    left = len(watch.left()) + (n - len(trees))
    print(f"cancel_all answered in {answered:.0f} ms, cancelled {body.get('cancelled')}; typed cancelled "
          f"results {typed}/{n}; sandboxes with processes left {left}; marker sleeps left in /proc "
          f"{len(leftover)}; sandboxes the host still lists {listed}; load {os.getloadavg()[0]:.1f}")
    print(f"result stored:  {_ms(result_ms)}  ({len(result_ms)} jobs)")
    print(f"sandbox gone:   {_ms(gone_ms)}  ({len(gone_ms)} jobs)")
    print(f"both:           {_ms(both)}")
    print("CPU s during the cancel: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])))
    print(f"bulk_cancel n={n} answered_ms={answered:.0f} p50_ms={statistics.median(both):.0f} "
          f"p99_ms={percentile(both, 0.99):.0f} left_sandboxes={left + len(leftover)}")


def one_by_one(stack: Stack, http: requests.Session, n: int, runtime: str) -> None:
    marker = ["sleep", f"{SLEEP_S}.{random.randrange(10**6):06d}"]
    ids, trees = start_sleepers(http, stack.api_url, n, runtime, marker, timeout_s=600)
    time.sleep(1.0)
    answered, gone = [], []
    for job_id in ids:
        pid = trees[job_id][0]
        start = time.perf_counter()
        view = http.delete(f"{stack.api_url}/jobs/{job_id}", timeout=30).json()
        answered.append((time.perf_counter() - start) * 1000)
        assert view["status"] == "cancelled" and view["result"]["critical_error"] == "cancelled"
        while alive(pid):  # gone, or a zombie its reaper has not collected yet
            time.sleep(0.0005)
        gone.append((time.perf_counter() - start) * 1000)
    leftover = marked(proc_table(), "\0".join(marker).encode() + b"\0")
    print(f"rollouts cancelled: {n}; sleep processes left: {len(leftover)}")
    print(f"DELETE answered:  p50 {statistics.median(answered):7.1f} ms  p99 {percentile(answered, 0.99):7.1f} ms")
    print(f"sandbox gone:     p50 {statistics.median(gone):7.1f} ms  p99 {percentile(gone, 0.99):7.1f} ms")
    print(f"cancel_p50_ms={statistics.median(gone):.1f} cancel_p99_ms={percentile(gone, 0.99):.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--bulk", action="store_true", help="one POST /cancel_all for all of them")
    parser.add_argument("--runtime", default=None, help="sandbox runtime (default: bwrap with --bulk, else local)")
    args = parser.parse_args()
    n, runtime = args.jobs, args.runtime or ("bwrap" if args.bulk else "local")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a pidfd per sandbox process
    options = StackOptions(redis_password=REDIS_PASSWORD, state_dir=Path(tempfile.mkdtemp(prefix="bench-cancel-")),
                           beat=False, persist=False,
                           concurrency={"init": 64 if args.bulk else 16, "run": n + 8, "eval": 8, "maint": 1},
                           env={"PRORL_SANDBOX_CAPACITY": str(n + 64)})
    stack = Stack(options)
    stack.start_redis(REDIS_PORT)
    http = requests.Session()
    with stack:
        http.headers["Authorization"] = f"Bearer {stack.api_token}"
        (bulk if args.bulk else one_by_one)(stack, http, n, runtime)


if __name__ == "__main__":
    main()
