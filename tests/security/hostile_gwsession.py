"""Shared parts of the gateway-session attacks in test_hostile_harness.py (issue 32, items 1, 2, 3
and 5): a backend that records the sampling set it is sent, and an attacker harness as a
``command`` line run in a bwrap sandbox, which prints what it saw as one ``SAW {json}`` line."""
from __future__ import annotations

import json
import threading

import psutil
import pytest
import requests

from tests.conftest import submit, wait

# Inside the sandbox: the attack's helpers, then the attack itself (each test's own text).
PRELUDE = r'''
import json, os, sys, threading, time, urllib.error, urllib.request
URL, KEY = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
TASK = open(os.environ["PRORL_TASK_FILE"]).read()
def ask(req):
    for attempt in range(50):  # a connection the gateway's backlog turned away is tried again
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")
        except (ConnectionError, urllib.error.URLError):
            time.sleep(0.05)
    return 0, {}
def post(path, body, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    return ask(urllib.request.Request(URL + path, data=data, method="POST",
        headers={"Authorization": "Bearer " + KEY, "Content-Type": "application/json"}))
def get(path):
    return ask(urllib.request.Request(URL + path, headers={"Authorization": "Bearer " + KEY}))[0]
def chat(messages, **extra):
    return post("/chat/completions", {"model": "m", "messages": messages, **extra})
def together(n, fn):
    out = [None] * n
    def one(i):
        out[i] = fn(i)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads: t.start()
    for t in threads: t.join()
    return out
SAW = {}
'''
EPILOGUE = "\nprint('SAW ' + json.dumps(SAW))\n"
ORACLE = ["--policy", "oracle:prorl_celery.fakes.harness_oracle:reply"]


def attacker(script: str) -> str:
    """The attack as a command line (nothing of the test's files is in the sandbox)."""
    return f"python3 -I - <<'PY'\n{PRELUDE}\n{script}\n{EPILOGUE}\nPY"


def saw(result: dict) -> dict:
    """What the attacker printed."""
    output = result["harness"]["output"]
    lines = [x for x in output.splitlines() if x.startswith("SAW ")]
    assert lines, f"the attacker said nothing ({result['harness'].get('exit_code')}): {output[-2000:]}"
    return json.loads(lines[-1][4:])


def run(api: str, script: str, timeout: float = 180, sampling_params: dict | None = None, **agent) -> dict:
    """Run the attack as a math job's harness; its job view."""
    from prorl_celery.fakes.problems import MATH

    instance = {"data_source": "math", "problem": MATH[0]["problem"], "answer": MATH[0]["answer"],
                "agent": {"harness": "command", "command": attacker(script), "wall_s": 120, **agent}}
    return wait(api, submit(api, instance, sampling_params=sampling_params or {}), timeout=timeout)


def served(url: str, since: int = 0) -> list[dict]:
    """What the backend received (generations that completed)."""
    got = requests.get(f"{url}/debug/requests", params={"since": since}, timeout=10).json()["requests"]
    return [r for r in got if r["status"] == "ok"]


def seen_so_far(url: str) -> int:
    return len(requests.get(f"{url}/debug/requests", timeout=10).json()["requests"])


@pytest.fixture(scope="module")
def recording_llm(stack, api):
    """The harness oracle as the one token-mode backend, in vLLM's ``/inference/v1/generate``
    dialect (its records keep the sampling set each call was sent), each token 20 ms (calls
    started together are in flight together)."""
    requests.post(f"{api}/clear_llm_server", timeout=10)
    url = stack.start_fake_llm(name="fake-recording-oracle", extra_args=[
        *ORACLE, "--latency-model", "step_s=0.02,capacity=64,slowdown=0"])
    resp = requests.post(f"{api}/llm_servers", json={"address": url, "protocol": "generate",
                                                      "dialect": "vllm-generate", "weight_version": "w1"}, timeout=10)
    assert resp.status_code == 201, resp.text
    yield url
    requests.post(f"{api}/clear_llm_server", timeout=10)


class PeakRss:
    """The largest resident size ``process`` reached while the block ran (sampled every 20 ms)."""

    def __init__(self, process: psutil.Process):
        self.process, self.rss = process, process.memory_info().rss
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._done.wait(0.02):
            try:
                self.rss = max(self.rss, self.process.memory_info().rss)
            except psutil.Error:
                return

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(5)
