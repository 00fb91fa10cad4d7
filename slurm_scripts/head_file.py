"""The head's address file (``KEY='value'`` lines the head writes once it is up and removes when it
stops) and whether the head it names still runs: its Slurm job, and its Redis answering a PING.
Standard library only, as :mod:`prorl_slurm`, which imports it from the same directory."""
from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import urllib.parse


def redis_ping(url: str, timeout: float = 3.0) -> bool:
    """PING (after AUTH when the URL has a password) over a raw socket: no redis package needed."""
    parts = urllib.parse.urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379),
                                      timeout=timeout) as sock:
            commands = []
            if parts.password:
                password = urllib.parse.unquote(parts.password)
                user = urllib.parse.unquote(parts.username) if parts.username else None
                commands.append(["AUTH", user, password] if user else ["AUTH", password])
            commands.append(["PING"])
            payload = b""
            for command in commands:
                payload += f"*{len(command)}\r\n".encode()
                for arg in command:
                    data = arg.encode()
                    payload += b"$%d\r\n%s\r\n" % (len(data), data)
            sock.sendall(payload)
            reply = b""
            while reply.count(b"\r\n") < len(commands):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
    except OSError:
        return False
    return reply.split(b"\r\n")[len(commands) - 1] == b"+PONG"


def read_env(path: str) -> dict[str, str]:
    values: dict[str, str] = {}
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            for word in shlex.split(line):
                key, sep, value = word.partition("=")
                if sep:
                    values[key] = value
    return values


def write_env(path: str, pairs: dict[str, str]) -> None:
    """Write KEY='value' lines atomically, readable by the owner only (the file holds tokens)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    lines = ["# prorl-celery head address: written by slurm_scripts/head.sbatch once the head is up,",
             "# removed when it stops. Shell syntax: `source` it, or read it with prorl_slurm.py."]
    lines += [f"{key}={shlex.quote(value)}" for key, value in pairs.items()]
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
        fh.write("\n".join(lines) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def job_running(job_id: str) -> bool | None:
    """Whether Slurm says the job runs; None when that cannot be asked (no squeue here)."""
    if not job_id or not shutil.which("squeue"):
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        # squeue fails for a job id it has forgotten: that job is long gone.
        return False if "Invalid job id" in out.stderr else None
    return out.stdout.strip().startswith("RUNNING")


def head_ready(path: str) -> dict[str, str] | None:
    """The head file's values once it exists, names a running head job and its Redis answers."""
    try:
        values = read_env(path)
    except (OSError, ValueError):
        return None
    if job_running(values.get("PRORL_HEAD_JOB_ID", "")) is False:
        return None  # a stale file left by a head that was killed outright
    url = values.get("PRORL_REDIS_URL")
    return values if url and redis_ping(url) else None
