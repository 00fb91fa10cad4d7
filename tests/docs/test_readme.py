"""The README, run as a new user runs it: its commands verbatim, in an environment with nothing of
the test session in it (tests/docs/readme.py: no ``PRORL_*``, a new HOME), on a private network
namespace so its fixed ports are its own. What a README command needs beyond its own text is a
README bug, and fails here.

The set-up command's ``python3 -m pip install -e .`` is not rerun here: ``scripts/test.sh`` (the
README's other set-up command, which runs this suite) has just run ``pip install -e '.[test]'``,
a superset; the rest of the line runs verbatim.
"""
from __future__ import annotations

import json
import os
import re
import signal
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.docs.readme import ROOT, blocks, private_network, sections, user_env, without_bwrap
from tests.docs.service import Running

SETUP = "Set up"
PIP = "python3 -m pip install -e ."


def _setup_commands() -> list[str]:
    return blocks(SETUP)


def test_the_setup_section_has_exactly_two_commands():
    first, second = _setup_commands()  # exactly two: the service with its demo, and the tests
    assert first.split(" && ")[0] == PIP and "up --demo" in first
    assert second == "bash scripts/test.sh"
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"^{re.escape(second)}\s*$", ci, re.M), "CI must run the README's test command"


def _demo_rows(output: str) -> list[list[str]]:
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:3] == ["job", "domain", "status"])
    return [line.split() for line in lines[start + 1:] if re.match(r"^[0-9a-f]{12}\s", line)]


@pytest.mark.parametrize("bwrap", ["with-bwrap", pytest.param("without-bwrap", marks=pytest.mark.slow)])
def test_first_command_runs_every_demo_job_on_a_fresh_machine(tmp_path, bwrap):
    first = _setup_commands()[0]
    rest = first.split(" && ", 1)[1] if first.startswith(PIP + " && ") else first
    env = user_env(tmp_path / "home")
    mount = without_bwrap(tmp_path) if bwrap == "without-bwrap" else []
    if bwrap == "without-bwrap" and not mount:
        pytest.skip("bubblewrap is not installed: the with-bwrap case is this machine's")
    with private_network() as net:
        demo = Running(rest, env, ROOT, prefix=[*net, *mount])
        try:
            code = demo.wait(420)
        finally:
            demo.stop()
    out = demo.output
    assert code == 0, out
    assert "Traceback" not in out, out
    rows = _demo_rows(out)
    assert len(rows) == 8 and all(row[2] == "completed" for row in rows), out
    rewards = {row[1]: float(row[3]) for row in rows if row[1] != "shell"}
    assert rewards == {"swe": 1.0, "humaneval": 1.0, "math": 1.0, "stem": 1.0}, out
    assert sorted(float(row[3]) for row in rows if row[1] == "shell") == [0.0, 1.0], out
    assert ("WITHOUT ISOLATION" in out) == (bwrap == "without-bwrap"), out


@pytest.mark.slow
def test_up_without_bwrap_says_how_to_fix_it_in_one_message(tmp_path):
    mount = without_bwrap(tmp_path)
    if not mount:
        pytest.skip("bubblewrap is not installed")
    with private_network() as net:
        up = Running("prorl-celery up --state-dir ~/prorl", user_env(tmp_path / "home"), ROOT,
                     prefix=[*net, *mount])
        try:
            code = up.wait(180)
        finally:
            up.stop()
    assert code != 0 and "Traceback" not in up.output, up.output
    assert "install-system-deps.sh" in up.output and "--dev" in up.output, up.output


def _json_docs(text: str) -> list[dict]:
    decoder, docs, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i] in "{[":
            doc, i = decoder.raw_decode(text, i)
            docs.append(doc)
        else:
            i += 1
    return docs


def test_using_it_and_the_plain_http_trainer_loop_work_as_written(tmp_path):
    start, client = blocks("Using it")[:2]
    plain_http = next(b for b in blocks("Use it from your trainer") if "/groups" in b)
    env = user_env(tmp_path / "home")
    with private_network() as net:
        up = Running(start, env, ROOT, prefix=net)
        try:
            up.expect("ready", 180)
            shell = subprocess.run([*net, "bash", "-euo", "pipefail", "-c", client], env=env,
                                   cwd=tmp_path, capture_output=True, text=True, timeout=120)
            assert shell.returncode == 0, shell.stdout + shell.stderr
            job = _json_docs(shell.stdout)[-1]
            assert job["status"] == "completed" and job["result"]["reward"] == 1.0, shell.stdout

            trainer = subprocess.run([*net, "bash", "-euo", "pipefail", "-c", plain_http], env=env,
                                     cwd=tmp_path, capture_output=True, text=True, timeout=120)
            assert trainer.returncode == 0, trainer.stdout + trainer.stderr
            resumed, group, completions = _json_docs(trainer.stdout)
            assert resumed["resumed"] and all(b["weight_version"] == "step12" for b in resumed["backends"])
            assert len(group["job_ids"]) == 4
            assert completions["cursor"] and completions["completions"], trainer.stdout

            byoa = next(b for b in blocks("Bring your own agent") if '"harness"' in b)
            harness = _run_block(net, byoa, env, tmp_path, timeout=300)
            assert harness.returncode == 0, harness.stdout + harness.stderr
            registered, job = _json_docs(harness.stdout)
            assert registered["backend"]["protocol"] == "generate", registered
            result = job["result"]
            assert job["status"] == "completed" and result["reward"] == 1.0, harness.stdout
            assert result["token_mode"] == "exact" and result["finish_reason"] == "submitted", result
        finally:
            up.stop()
    assert "Traceback" not in up.output, up.output


def _run_block(net: list[str], block: str, env: dict[str, str], cwd: Path,
               timeout: float) -> subprocess.CompletedProcess:
    """``block`` in ``bash -euo pipefail``, in its own session; whatever it left running in the
    background (a server started with ``&``) is killed with its process group afterwards."""
    proc = subprocess.Popen([*net, "bash", "-euo", "pipefail", "-c", block], env=env, cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(10)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# paths the README names in other projects' trees, not in this one
FOREIGN_PATHS = {"tests/runtests.py",  # Django's own test runner, in a Django checkout
                 "tests/test.sh"}  # a Harbor task folder's verifier


def _mentioned(pattern: str) -> set[str]:
    return set(re.findall(pattern, (ROOT / "README.md").read_text()))


def test_every_script_marker_and_path_the_readme_names_exists():
    text = (ROOT / "README.md").read_text()
    for script in _mentioned(r"bash (scripts/[\w./-]+\.sh)"):
        assert (ROOT / script).is_file(), script
    registered = set(re.findall(r"^\s+(\w+): ", (ROOT / "setup.cfg").read_text().split("markers =")[1]
                                .split("addopts")[0], re.M))
    for marker in _mentioned(r"scripts/test\.sh -m (\w+)"):
        assert marker in registered, f"README runs `-m {marker}`, which setup.cfg does not register"
    for path in _mentioned(r"`((?:examples|tests|bench|slurm_scripts|scripts)/[\w./-]+)`") - FOREIGN_PATHS:
        assert (ROOT / path.rstrip("/")).exists(), path
    for module in _mentioned(r"python3? -m ([\w.]+)"):
        if module.split(".")[0] in ("prorl_celery", "sandboxes", "tasks", "flask_api"):
            found = subprocess.run(["python3", "-c", f"import importlib.util as u; "
                                    f"assert u.find_spec({module!r})"], cwd=ROOT, capture_output=True)
            assert found.returncode == 0, module
    assert "Using it" in sections() and "Set up" in sections()
    assert shlex.split(_setup_commands()[1]) == ["bash", "scripts/test.sh"], text[:0]


HEAD = "10.77.0.1"  # the head node's address on the test's private network


def _cluster_lines() -> tuple[str, list[str], str]:
    """The cluster block: its ``export`` line, the long-running commands, the one-shot status."""
    lines = [line for line in blocks("Running the parts yourself (a cluster)")[0].splitlines() if line]
    export, *services, status = lines
    assert export.startswith("export ") and {w.split("=")[0] for w in export.split()[1:]} == {
        "PRORL_REDIS_URL", "PRORL_API_TOKEN"}, export
    assert status.split("#")[0].strip() == "prorl-celery status", status
    return export, services, status


@pytest.mark.slow
def test_the_cluster_commands_run_as_written(tmp_path):
    """Every line of the cluster block verbatim, on a node with a non-loopback address, against the
    head's Redis; only the ``export`` line's values are the test's own (its Redis, its token)."""
    import requests

    _, services, status = _cluster_lines()
    env = user_env(tmp_path / "home")
    password, token = "readme-" + tmp_path.name[-8:] + "x" * 16, "token-" + "y" * 24
    with private_network(address=HEAD) as net:
        if not net:
            pytest.skip("needs root for a private network namespace (the block binds 0.0.0.0:8000)")
        redis_line = (f"python3 -m prorl_celery.ops.redis_server --port 6379 --bind {HEAD} "
                      f"--dir {tmp_path / 'redis'} --appendfsync no")
        head = Running(redis_line, {**env, "PRORL_REDIS_PASSWORD": password}, tmp_path, prefix=net)
        node_env = {**env, "PRORL_REDIS_URL": f"redis://:{password}@{HEAD}:6379/0",
                    "PRORL_API_TOKEN": token}
        running = [head]
        try:
            head.expect("Ready to accept connections", 30)
            running += [Running(line, node_env, tmp_path, prefix=net) for line in services]
            api = f"http://{HEAD}:8000"
            http = [*net, "python3", "-c", _HTTP_PROBE, api, token]
            probe = subprocess.run(http, env=env, capture_output=True, text=True, timeout=240)
            assert probe.returncode == 0, probe.stdout + probe.stderr + "".join(
                f"\n--- {r.line}\n{r.output[-2000:]}" for r in running)
            report = json.loads(probe.stdout)
            assert report["job"]["status"] == "completed" and report["job"]["result"]["reward"] == 1.0
            assert report["host_address"] != "127.0.0.1" and HEAD in report["host_address"], report
            assert report["flower"] == [401, 200], report
            shown = subprocess.run([*net, "bash", "-c", status], env=node_env, cwd=tmp_path,
                                   capture_output=True, text=True, timeout=60)
            assert shown.returncode == 0 and "run" in shown.stdout, shown.stdout + shown.stderr
        finally:
            for part in reversed(running):
                part.stop(30)
    for part in running[1:]:
        assert "Traceback" not in part.output, part.line + "\n" + part.output


# Run inside the private network: wait for the block's API to see every queue's worker and the
# sandbox host, run a shell job through it, and ask Flower with and without its credentials.
_HTTP_PROBE = r'''
import json, sys, time, requests
api, token = sys.argv[1:3]
auth = {"Authorization": f"Bearer {token}"}
deadline = time.monotonic() + 180
while True:
    try:
        health = requests.get(f"{api}/healthz", timeout=5).json()
        if all(health.get("workers", {}).get(q) for q in ("init", "run", "eval", "maint")):
            break
    except (requests.RequestException, ValueError):
        pass
    if time.monotonic() > deadline:
        sys.exit(f"workers never all up: {health if 'health' in dir() else None}")
    time.sleep(0.5)
job_id = None
while job_id is None and time.monotonic() < deadline:  # init waits for a registered host itself
    resp = requests.post(f"{api}/jobs", json={"instance": {"data_source": "shell",
                         "commands": ["echo hello from a node"]}}, headers=auth, timeout=30)
    job_id = resp.json()["job_ids"][0] if resp.status_code == 202 else time.sleep(1)
job = requests.get(f"{api}/jobs/{job_id}/wait", params={"timeout": 120}, headers=auth, timeout=150).json()
hosts = requests.get(f"{api}/healthz", timeout=5).json().get("sandbox_hosts") or []
flower_url = api.rsplit(":", 1)[0] + ":5555/"
flower = []
for creds in (None, ("user", "pass")):
    for _ in range(120):
        try:
            flower.append(requests.get(flower_url, auth=creds, timeout=5).status_code)
            break
        except requests.RequestException:
            time.sleep(0.5)
print(json.dumps({"job": job, "flower": flower,
                  "host_address": json.dumps(hosts) if hosts else job["result"].get("sandbox", {}).get("host", "")}))
'''


@pytest.mark.swebench
def test_the_swebench_environment_command_builds_as_written(tmp_path):
    """The SWE-bench section's build command, verbatim but for its two placeholders: ``row.json``
    (a real row, written where the user runs it) and ``<clone of the repository>`` (its base
    tree). The printed directory is an environment a sandbox can use as its image."""
    from tests.real.swebench_data import materialize, rows

    section = sections()["SWE-bench rows and their environments"]
    line = next(b for b in blocks("SWE-bench rows and their environments") if "tasks.swe.env" in b)
    command = line.splitlines()[0].split("  #")[0].strip()
    assert "<clone of the repository>" in command and "row.json" in command and "swebench" in section
    row = rows()["marshmallow-code__marshmallow-1359"]
    (tmp_path / "row.json").write_text(json.dumps(row))
    repo = materialize(row, tmp_path / "marshmallow")
    command = command.replace("<clone of the repository>", shlex.quote(str(repo)))
    built = subprocess.run(["bash", "-c", command], env=user_env(tmp_path / "home"), cwd=tmp_path,
                           capture_output=True, text=True, timeout=1800)
    assert built.returncode == 0, built.stdout + built.stderr
    env_dir = Path(built.stdout.strip().splitlines()[-1])
    assert env_dir.is_dir() and any((env_dir / p).exists() for p in ("usr/bin/python3", "bin/python3"))
