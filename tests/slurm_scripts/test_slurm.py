"""The Slurm deployment (slurm_scripts/) on a real one-node Slurm cluster.

``scripts/install-slurm.sh`` installs and starts Slurm (munged, slurmctld, slurmd) if needed; those
daemons are system services and stay running after the test. Then: ``sbatch`` the head, the worker
nodes and an LLM server job (the fake LLM server, registered through register_llm.sh); a rollout
completes through the API; a long rollout holds a sandbox; ``scancel`` stops everything, and no
process, sandbox, listening port or address file of the stack is left, while Redis' AOF is on disk.

Run with ``pytest -m slurm`` (deselected by default). Needs root to install Slurm, unless Slurm is
already installed and running.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import psutil
import pytest
import requests

from prorl_celery.ops.procs import free_port
from tests.helpers import read_env_file

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "slurm_scripts"
INSTALL = ROOT / "scripts" / "install-slurm.sh"
STACK_MARKERS = ("redis-server", "celery", "prorl_celery", "sandbox-host", "fake-llm", "http.server")


# -- helpers ------------------------------------------------------------------------------------
def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, **kwargs)


def poll(predicate, timeout: float, what: str, pause: float = 0.5, diagnose=None):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f"\n{diagnose()}" if diagnose else ""
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}{detail}")
        time.sleep(pause)


def job_state(job_id: str) -> str:
    """Slurm's state of the job; '' once Slurm has forgotten it."""
    out = run(["scontrol", "show", "job", "-o", job_id])
    for word in out.stdout.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    return ""


def job_ended(job_id: str) -> bool:
    return job_state(job_id) not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED")


def recorded_pids(log_dir: Path) -> dict[str, int]:
    """The "NAME PID" lines the scripts write for each component."""
    pids = {}
    for path in log_dir.glob("*.pids"):
        for line in path.read_text().splitlines():
            name, _, pid = line.partition(" ")
            if pid.strip().isdigit():
                pids[f"{path.stem}/{name}"] = int(pid)
    return pids


def snapshot(pids) -> dict[int, tuple[float, str]]:
    """pid -> (create time, command line) of the given processes and all their descendants."""
    seen = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            family = [proc, *proc.children(recursive=True)]
        except psutil.Error:
            continue
        for member in family:
            try:
                seen[member.pid] = (member.create_time(), " ".join(member.cmdline()))
            except psutil.Error:
                pass
    return seen


def still_alive(seen: dict[int, tuple[float, str]]) -> list[str]:
    alive = []
    for pid, (created, cmd) in seen.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid}: {cmd}")
        except psutil.Error:
            pass
    return alive


def leftovers(job_ids: set[str], sandbox_root: Path, state_dir: Path) -> list[str]:
    """Processes that belong to the stack: started by our jobs (SLURM_JOB_ID in their
    environment), working in our sandbox root, or naming our state directory."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get("SLURM_JOB_ID") in job_ids:
                found.append(f"{proc.pid} (job {proc.environ()['SLURM_JOB_ID']}): {cmd}")
            elif str(sandbox_root) in proc.cwd():
                found.append(f"{proc.pid} (sandbox cwd {proc.cwd()}): {cmd}")
            elif str(state_dir) in cmd and any(marker in cmd for marker in STACK_MARKERS):
                found.append(f"{proc.pid} (state dir): {cmd}")
        except psutil.Error:
            pass
    return found


def listening(ports: set[int]) -> list[str]:
    return [f"{conn.laddr.ip}:{conn.laddr.port} pid {conn.pid}"
            for conn in psutil.net_connections(kind="tcp")
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port in ports]


def fake_llm_command() -> str:
    """The package's fake LLM server if this checkout has it, else a plain HTTP server (the
    registration only needs something that answers HTTP)."""
    probe = run([sys.executable, "-m", "prorl_celery.ops.cli", "fake-llm", "--help"])
    python = shlex.quote(sys.executable)
    if probe.returncode == 0:
        return f"exec {python} -m prorl_celery.ops.cli fake-llm --host 0.0.0.0 --port {{port}}"
    return f"exec {python} -m http.server {{port}} --bind 0.0.0.0"


# -- the cluster ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm() -> None:
    if os.geteuid() == 0:
        out = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, timeout=840)
        if out.returncode == 2:
            pytest.skip(f"cannot install Slurm here: {out.stderr.strip()}")
        assert out.returncode == 0, f"install-slurm.sh failed:\n{out.stdout}\n{out.stderr}"
    elif not shutil.which("sbatch"):
        pytest.skip("Slurm is not installed and installing it needs root")
    if run(["sinfo", "-h"]).returncode != 0:
        pytest.skip("Slurm is installed but does not answer (sinfo fails); run "
                    "scripts/install-slurm.sh as root")


def _assert_hardened_redis(url: str, state_dir: Path) -> None:
    """The head's Redis is the hardened one: password required, MODULE/CONFIG/DEBUG gone, not
    root, state dir 0700, secrets 0600, no password in any argv."""
    import redis

    parts = urllib.parse.urlsplit(url)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=parts.hostname, port=parts.port).ping()
    client = redis.Redis.from_url(url)
    for command in (("MODULE", "LIST"), ("CONFIG", "GET", "dir"), ("DEBUG", "SLEEP", "0")):
        with pytest.raises(redis.ResponseError, match="unknown command"):
            client.execute_command(*command)
    servers = [p for p in psutil.process_iter(["name", "uids", "cmdline"]) if p.info["name"] == "redis-server"
               and f":{parts.port}" in " ".join(p.info["cmdline"] or [])]
    assert servers and all(p.info["uids"].real != 0 for p in servers) or os.geteuid() != 0, servers
    assert oct(state_dir.stat().st_mode & 0o777) == "0o700"
    assert oct((state_dir / "secrets.env").stat().st_mode & 0o777) == "0o600"
    argvs = [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])]
    assert not [a for a in argvs if parts.password in a]


# -- the test -----------------------------------------------------------------------------------
def test_sbatch_stack_runs_a_rollout_and_scancel_leaves_nothing(slurm, tmp_path):
    state_dir = tmp_path / "state"
    log_dir = state_dir / "logs"
    sandbox_root = tmp_path / "sandboxes"
    sandbox_root.mkdir()
    head_file = tmp_path / "prorl-head.env"
    tenants = tmp_path / "tenants.toml"  # the head makes these projects (issue 36)
    tenants.write_text('[projects.train]\nweight = 2\n\n[projects.evaluation]\n')
    ports = {"redis": free_port(), "api": free_port(), "flower": free_port(), "llm": free_port()}
    env = {key: value for key, value in os.environ.items()
           if key not in ("PRORL_REDIS_URL", "PRORL_RESULT_URL", "PRORL_API_TOKEN")}
    env.update({
        "PRORL_PYTHON": sys.executable,
        "PRORL_STATE_DIR": str(state_dir),
        "PRORL_HEAD_FILE": str(head_file),
        "PRORL_REDIS_PORT": str(ports["redis"]),
        "PRORL_API_PORT": str(ports["api"]),
        "PRORL_FLOWER_PORT": str(ports["flower"]),
        "PRORL_STOP_GRACE_S": "5",
        "PRORL_HEAD_WAIT_S": "180",
        "PRORL_SANDBOX_RUNTIME_CONFIG": json.dumps({"local": {"root": str(sandbox_root)}}),
        "PRORL_ALLOW_LOCAL_RUNTIME": "1",  # the test's rollouts name the (unisolated) local runtime
        "PRORL_LLM_CMD": fake_llm_command(),
        "PRORL_LLM_PORT": str(ports["llm"]),
        "PRORL_LLM_REGISTER_ARGS": "--capacity 8 --timeout 180 --wait-llm 60",
        "PRORL_PROJECTS_FILE": str(tenants),
    })
    # Small jobs that may share the test machine's CPUs; a time limit as the last safety net.
    common = ["--parsable", "--oversubscribe", "--cpus-per-task=1", "--time=15",
              f"--chdir={tmp_path}"]
    jobs: dict[str, str] = {}

    def sbatch(name: str, script: str, *extra: str) -> str:
        out = run(["sbatch", *common, f"--output={tmp_path}/{name}-%j.out", *extra,
                   str(SCRIPTS / script)], env=env, cwd=tmp_path)
        assert out.returncode == 0, f"sbatch {script}: {out.stderr}"
        jobs[name] = out.stdout.strip().split(";")[0]
        return jobs[name]

    def diagnose() -> str:
        parts = [run(["squeue"]).stdout]
        for path in sorted(tmp_path.glob("*.out")) + sorted(log_dir.glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    started = time.monotonic()
    try:
        head = sbatch("head", "head.sbatch")
        sbatch("workers", "workers.sbatch", f"--dependency=after:{head}")
        sbatch("llm", "llm_server.sbatch")

        # -- the head writes its address once it is up; the workers register -----------------
        poll(head_file.exists, 120, "the head's address file", diagnose=diagnose)
        head_info = read_env_file(head_file)
        assert head_info["PRORL_HEAD_JOB_ID"] == head
        api = head_info["PRORL_API_URL"]
        assert api.endswith(f":{ports['api']}") and socket.gethostname() in api
        assert oct(head_file.stat().st_mode & 0o777) == "0o600"
        http = requests.Session()
        http.headers["Authorization"] = f"Bearer {head_info['PRORL_API_TOKEN']}"
        assert requests.get(f"{api}/llm_servers", timeout=10).status_code == 401  # token required
        for name in ("train", "evaluation"):  # the tenant file's projects, each with a key of its own
            key = (state_dir / "project-keys" / f"{name}.key").read_text().strip()
            mine = requests.get(f"{api}/weights", headers={"Authorization": f"Bearer {key}"}, timeout=10)
            assert mine.status_code == 200, mine.text
        _assert_hardened_redis(head_info["PRORL_REDIS_URL"], state_dir)

        def all_queues_served():
            body = http.get(f"{api}/healthz", timeout=10).json()
            return all(body["workers"].get(q, 0) >= 1 for q in ("init", "run", "eval", "maint"))
        poll(all_queues_served, 120, "a worker on every queue", diagnose=diagnose)
        assert requests.get(head_info["PRORL_FLOWER_URL"], timeout=10).status_code == 401
        flower = requests.get(head_info["PRORL_FLOWER_URL"], timeout=10,
                              auth=tuple(head_info["PRORL_FLOWER_AUTH"].split(":", 1)))
        assert flower.status_code == 200, flower.text[:300]
        up_s = time.monotonic() - started

        # -- a rollout completes through the API ----------------------------------------------
        instance = {"data_source": "shell", "commands": ["echo hi"], "sandbox": {"runtime": "local"}}
        resp = http.post(f"{api}/jobs", json={"instance": instance}, timeout=30)
        assert resp.status_code == 202, resp.text
        job_id = resp.json()["job_ids"][0]
        resp = http.get(f"{api}/jobs/{job_id}/wait", params={"timeout": 60}, timeout=90)
        assert resp.status_code == 200, resp.text
        record = resp.json()
        assert record["status"] == "completed", record
        assert record["result"]["reward"] == 1.0, record

        # -- the LLM server job registered its server through register_llm.sh -----------------
        def llm_registered():
            backends = http.get(f"{api}/llm_servers", timeout=10).json()["backends"]
            return [b for b in backends if b["address"].rstrip("/").endswith(f":{ports['llm']}")]
        backend = poll(llm_registered, 120, "the LLM server's registration", diagnose=diagnose)[0]
        assert backend["capacity"] == 8

        # -- a long rollout holds a sandbox (a shell running `sleep`) while we cancel ------------
        long_instance = dict(instance, commands=["sleep 600"])
        resp = http.post(f"{api}/jobs", json={"instance": long_instance}, timeout=30)
        long_id = resp.json()["job_ids"][0]
        poll(lambda: http.get(f"{api}/jobs/{long_id}", timeout=10).json()["status"] == "run", 60,
             "the long rollout to run", diagnose=diagnose)

        def sandbox_shells():
            return [p for p in psutil.process_iter(["cwd"]) if str(sandbox_root) in (p.info["cwd"] or "")]
        poll(sandbox_shells, 30, "the long rollout's sandbox shell", diagnose=diagnose)

        pids = recorded_pids(log_dir)
        names = {name.split("/")[1] for name in pids}
        assert {"redis", "api", "beat", "flower", "nodes", "sandbox-host", "worker-init",
                "worker-run", "worker-eval", "worker-maint", "server-0"} <= names, pids
        seen = snapshot(pids.values())
        assert any("sleep 600" in cmd for _, cmd in seen.values()), "the sandbox is not under the job"
        host_file = next(log_dir.glob("node-*-sandbox-host.json"))
        ports["sandbox"] = json.loads(host_file.read_text())["port"]

        # -- scancel the LLM job: it deregisters its server and stops it ------------------------
        assert run(["scancel", jobs["llm"]]).returncode == 0
        poll(lambda: job_ended(jobs["llm"]), 60, "the LLM job to end", diagnose=diagnose)
        assert not llm_registered(), "the LLM server is still registered after its job ended"

        # -- scancel the rest: nothing of the stack may remain ----------------------------------
        cancel_at = time.monotonic()
        assert run(["scancel", jobs["head"], jobs["workers"]]).returncode == 0
        poll(lambda: all(job_ended(j) for j in jobs.values()), 90, "the jobs to end", diagnose=diagnose)
        stop_s = time.monotonic() - cancel_at

        poll(lambda: not still_alive(seen), 15, "the stack's processes to exit",
             diagnose=lambda: "\n".join(still_alive(seen)))
        assert not leftovers(set(jobs.values()), sandbox_root, state_dir)
        assert not listening(set(ports.values()))
        assert not head_file.exists(), "the head's address file outlived the head"
        aof = list((state_dir / "redis").glob("appendonly*.aof")) + \
            list((state_dir / "redis").glob("appendonlydir/*.aof"))
        assert aof and sum(path.stat().st_size for path in aof) > 0, "no AOF: Redis did not persist"
        assert "stopped" in (tmp_path / f"head-{head}.out").read_text()
        print(f"\nslurm: stack up in {up_s:.1f}s, stopped {stop_s:.1f}s after scancel, "
              f"total {time.monotonic() - started:.1f}s")
    finally:
        if jobs:
            run(["scancel", *jobs.values()])
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not all(job_ended(j) for j in jobs.values()):
                time.sleep(0.5)
