"""CPU of the calling process per LLM call and per sandbox exec, for two code trees side by side.

One fake LLM server (``python -m prorl_celery.fakes.llm.server``, no latency) and one sandbox
host (``local`` runtime) are started from this tree; each tree's client then runs ``--n`` calls
of each kind in a fresh process: ``Call`` + ``request_json`` of a 1-token chat completion, and
``RemoteSandbox.exec("true")`` on one sandbox. Reported: CPU ms per call of the calling process
(all its threads, the lease keeper included, ``time.process_time``) and of the server.

    python bench/client_cpu.py --before <commit> [--n 500] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def _server_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_llm(url: str, n: int) -> float:
    from prorl_celery.llm.transport import Call, request_json

    with Call(30) as call:
        request_json(call, "POST", url + "/v1/chat/completions", BODY)  # warm-up: imports, keeper
    started = time.process_time()
    for _ in range(n):
        with Call(30) as call:
            status, _ = request_json(call, "POST", url + "/v1/chat/completions", BODY)
        assert status == 200, status
    return time.process_time() - started


def measure_exec(address: str, token: str, n: int) -> float:
    from sandboxes.base import SandboxHandle
    from sandboxes.client import RemoteSandbox, request
    from sandboxes.protocol import SandboxEntry

    entry = SandboxEntry.model_validate(request("POST", address, token, "/sandboxes", 60, data=json.dumps(
        {"job_id": "bench-client-cpu", "spec": {"runtime": "local"}})).json())
    box = RemoteSandbox(SandboxHandle(host_id=entry.host_id, address=address, token=token,
                                      sandbox_id=entry.sandbox_id, runtime=entry.runtime), entry)
    try:
        box.exec("true", 30)
        started = time.process_time()
        for _ in range(n):
            assert box.exec("true", 30).exit_code == 0
        return time.process_time() - started
    finally:
        box.close()


def _start(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)


def _servers(state: Path) -> tuple[subprocess.Popen, str, subprocess.Popen, str, str]:
    sys.path.insert(0, str(REPO))
    from prorl_celery.ops.procs import free_port

    env = {**os.environ, "PYTHONPATH": str(REPO), "PRORL_STATE_DIR": str(state), "PRORL_ALLOW_LOCAL_RUNTIME": "1"}
    port = free_port()
    llm = _start([sys.executable, "-m", "prorl_celery.fakes.llm.server", "--port", str(port),
                  "--latency-model", "none"], env)
    token = "bench-token"
    host = _start([sys.executable, "-m", "sandboxes.host.main", "--no-register", "--runtimes", "local",
                   "--token", token, "--warm", "0", "--log-level", "WARNING"], env)
    line = host.stdout.readline().strip()
    if not line.startswith("sandbox-host ready"):
        llm.terminate()
        raise SystemExit(f"sandbox host did not start: {line}")
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            import urllib.request
            urllib.request.urlopen(url + "/health", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    return llm, url, host, line.split()[-1], token


def _run_tree(tree: Path, kind: str, args: list[str], n: int, server: subprocess.Popen) -> tuple[float, float]:
    """(client CPU ms per call, server CPU ms per call) of ``n`` calls by ``tree``'s code."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    before = _server_cpu_s(server.pid)
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure", kind, *args, "--n", str(n)],
                         cwd=tree, env=env, capture_output=True, text=True, check=True).stdout
    server_s = _server_cpu_s(server.pid) - before
    return float(out.split()[-1]) / n * 1000, server_s / n * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="the commit to compare with (checked out in a temporary worktree)")
    parser.add_argument("--n", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measure", choices=["llm", "exec"], help=argparse.SUPPRESS)
    parser.add_argument("target", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure == "llm":
        return print(measure_llm(args.target[0], args.n))
    if args.measure == "exec":
        return print(measure_exec(args.target[0], args.target[1], args.n))
    with tempfile.TemporaryDirectory(prefix="client-cpu-") as tmp:
        trees = {"after": REPO}
        if args.before:
            subprocess.run(["git", "worktree", "add", "--detach", f"{tmp}/before", args.before], cwd=REPO,
                           check=True, capture_output=True)
            trees["before"] = Path(tmp) / "before"
        llm, url, host, address, token = _servers(Path(tmp) / "state")
        try:
            for rnd in range(args.rounds):
                for name, tree in trees.items():
                    llm_ms = _run_tree(tree, "llm", [url], args.n, llm)
                    exec_ms = _run_tree(tree, "exec", [address, token], args.n, host)
                    print(json.dumps({"round": rnd, "tree": name, "llm_client_ms": round(llm_ms[0], 3),
                                      "llm_server_ms": round(llm_ms[1], 3), "exec_client_ms": round(exec_ms[0], 3),
                                      "exec_host_ms": round(exec_ms[1], 3)}), flush=True)
        finally:
            for proc in (llm, host):
                proc.terminate()
                proc.wait(10)
            if args.before:
                subprocess.run(["git", "worktree", "remove", "--force", f"{tmp}/before"], cwd=REPO, check=False)


if __name__ == "__main__":
    main()
