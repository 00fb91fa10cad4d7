"""A sandbox host started without --token takes its token from the settings (PRORL_HOST_TOKEN),
and --token wins over them: a real host process, asked over real HTTP."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.sandboxes.conftest import REPO


def _serve(tmp_path: Path, env_token: str | None, *argv: str) -> str:
    """Start a host, check its token opens its API, stop it; returns that token."""
    ready = tmp_path / "ready.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PRORL_ALLOW_LOCAL_RUNTIME": "1"}
    env.pop("PRORL_HOST_TOKEN", None)
    if env_token is not None:
        env["PRORL_HOST_TOKEN"] = env_token
    proc = subprocess.Popen([sys.executable, "-m", "sandboxes.host.main", "--no-register",
                             "--runtimes", "local", "--warm", "0", "--log-level", "WARNING",
                             "--runtime-config", json.dumps({"local": {"root": str(tmp_path)}}),
                             "--ready-file", str(ready), *argv],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("sandbox-host ready http://")
        info = json.loads(ready.read_text())
        answer = requests.get(f"{info['address']}/sandboxes", timeout=10,
                              headers={"Authorization": f"Bearer {info['token']}"})
        assert answer.status_code == 200
        return info["token"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("env_token, argv, expected", [
    ("from-the-environment", (), "from-the-environment"),
    ("from-the-environment", ("--token", "from-the-flag"), "from-the-flag"),
])
def test_token_comes_from_settings_unless_given(tmp_path, env_token, argv, expected):
    assert _serve(tmp_path, env_token, *argv) == expected


def test_without_either_the_token_is_random(tmp_path):
    first, second = _serve(tmp_path, None), _serve(tmp_path, None)
    assert first != second and len(first) >= 24
