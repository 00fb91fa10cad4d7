"""The service as a normal user (issue 12, problem 5): ``prorl-celery up`` started as ``nobody``
(its Redis, sandbox host, workers, beat, API and the oracle LLM all run as uid 65534) checks out a
SWE fixture whose files belong to yet another user and resolves it with the gold patch.

Python lives under root's home here (0700), so the service runs in a private mount namespace in
which ``/root`` is a traversable tmpfs with only the interpreter's directory bound back in;
nothing of the machine changes. Needs root (to switch users) and bubblewrap that works for an
unprivileged user.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import requests

from prorl_celery.fakes import swe

NOBODY = 65534
ROOT = Path(__file__).resolve().parents[3]


def _bwrap_works_for_nobody() -> bool:
    if os.geteuid() != 0 or not shutil.which("bwrap") or not shutil.which("unshare"):
        return False
    probe = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "bwrap",
                            "--ro-bind", "/", "/", "--unshare-user", "--unshare-pid", "--proc", "/proc", "true"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _bwrap_works_for_nobody(),
                                reason="needs root (to become nobody) and bubblewrap for unprivileged users")


def _python_home() -> str:
    """The interpreter's installation directory (its prefix), which the mount namespace exposes."""
    return os.path.realpath(sys.base_prefix)


def _namespace_script(stage: Path) -> str:
    """Shell run by ``unshare -m`` as root: /root traversable, then become nobody and ``up``."""
    home = _python_home()
    lines = ["set -e"]
    if home.startswith("/root/"):
        lines += [f"mount --bind {home} {stage}", "mount -t tmpfs -o mode=0755 tmpfs /root",
                  f"mkdir -p {home}", f"mount --bind {stage} {home}"]
    lines.append(f'exec setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups -- "$@"')
    return "\n".join(lines)


@pytest.fixture
def nobody_dir():
    path = Path(tempfile.mkdtemp(prefix="prorl-nonroot-"))
    path.chmod(0o755)
    for sub in ("home", "state", "sandboxes", "tmp", "cache", "stage"):
        (path / sub).mkdir()
        os.chown(path / sub, NOBODY, NOBODY)
    (path / "state").chmod(0o700)
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def _up(workdir: Path, repos: Path) -> subprocess.Popen:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(workdir / "home"), "LANG": "C.UTF-8",
           "TMPDIR": str(workdir / "tmp"), "PYTHONPATH": str(ROOT), "PRORL_REPO_SOURCE_DIRS": str(repos),
           "PRORL_SANDBOX_ROOT": str(workdir / "sandboxes"), "PRORL_REPO_CACHE": str(workdir / "cache"),
           "PRORL_SANDBOX_WARM": "0"}
    argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
            _namespace_script(workdir / "stage"), "up",
            sys.executable, "-m", "prorl_celery.ops.cli", "up", "--port", "0", "--state-dir", str(workdir / "state"),
            "--concurrency", "init=2,run=2,eval=2,maint=1"]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait_ready(proc: subprocess.Popen, timeout: float = 180) -> str:
    deadline, seen, api = time.monotonic() + timeout, [], None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        found = re.match(r"^api\s+(http://\S+)", line)
        api = found.group(1) if found else api
        if line.strip() == "ready" and api:
            return api
    raise AssertionError("prorl-celery up as nobody did not get ready:\n" + "".join(seen[-40:]))


def _token(state: Path) -> str:
    text = (state / "secrets.env").read_text()
    return re.search(r"^PRORL_API_TOKEN=(\S+)$", text, re.M).group(1).strip("'\"")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_service_as_nobody_checks_out_and_resolves_a_swe_instance(nobody_dir):
    repos = nobody_dir / "repos"
    instance = swe.build("statkit", repos)
    # the files belong to another user (uid 1000, unmapped in the sandboxes: a tar unpacked there
    # failed with "Cannot change ownership to uid 1000"), readable by all
    subprocess.run(["chown", "-R", "1000:1000", str(repos)], check=True)
    subprocess.run(["chmod", "-R", "a+rX", str(repos)], check=True)
    proc = _up(nobody_dir, repos)
    try:
        api = _wait_ready(proc)
        uids = {p.uids().real for p in psutil.Process(proc.pid).children(recursive=True)}
        assert uids == {NOBODY}, uids  # every process of the service, Redis and sandboxes included
        headers = {"Authorization": f"Bearer {_token(nobody_dir / 'state')}"}
        submitted = requests.post(f"{api}/jobs", json={"instance": instance}, headers=headers, timeout=30)
        assert submitted.status_code == 202, submitted.text
        job = submitted.json()["job_ids"][0]
        view = requests.get(f"{api}/jobs/{job}/wait", params={"timeout": 240}, headers=headers, timeout=260).json()
    finally:
        _stop(proc)
    result = view["result"]
    assert view["status"] == "completed", json.dumps(result)[:3000]
    assert result["resolved"] is True and result["reward"] == 1.0, result["eval"]
    assert result["eval"]["FAIL_TO_PASS"] == {t: "PASSED" for t in instance["FAIL_TO_PASS"]}
