"""What both learning runs share: install the trainers (and a harness), run an example script
with its own stack, keep its log, read its curve."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, TEST_ENV

SEED = int(os.environ.get("PRORL_LEARNING_SEED", "1"))  # the two recorded runs of each: seeds 1 and 2


def run_example(script: str, name: str, steps: int, tmp_path_factory: Any, harnesses: tuple[str, ...] = (),
                needs: tuple[Path, ...] = ()) -> dict[str, Any]:
    """``examples/<script>`` for ``steps`` steps at ``SEED``; its ``<name>_seed<S>.json``. Skips
    when the trainers (or a file in ``needs``) could not be installed."""
    subprocess.run(["bash", str(ROOT / "scripts" / "install-trainers.sh"), "trl"], check=False, timeout=1800)
    if harnesses:
        subprocess.run(["bash", str(ROOT / "scripts" / "install-harnesses.sh"), *harnesses], check=False,
                       timeout=900)
    missing = [m for m in ("torch", "trl", "datasets", "matplotlib") if importlib.util.find_spec(m) is None]
    model = os.environ.get("PRORL_SMOL_MODEL", os.path.expanduser("~/.cache/prorl-celery/smollm2-135m-f32"))
    missing += [str(p) for p in (Path(model) / "config.json", *needs) if not p.is_file()]
    if missing:
        pytest.skip(f"scripts/install-trainers.sh (or install-harnesses.sh) could not install {missing}")
    # PRORL_LEARNING_OUT keeps the curve, its figures and the log (bench/learning for the record)
    out = Path(os.environ.get("PRORL_LEARNING_OUT") or tmp_path_factory.mktemp("learning"))
    out.mkdir(parents=True, exist_ok=True)
    # the example starts its own stack with the operator's defaults: not the test session's Redis,
    # token or its short stage leases (built for fault tests, they would requeue slow stages here)
    dropped = (set(TEST_ENV) - {"PYTHONPATH"}) | {"PRORL_REDIS_URL", "PRORL_API_TOKEN"}
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--steps", str(steps),
                           "--seed", str(SEED), "--out", str(out)], env=env, cwd=ROOT, timeout=3300,
                          capture_output=True, text=True)
    (out / f"{name}_seed{SEED}.log").write_text(done.stdout)
    assert done.returncode == 0, done.stderr[-4000:]
    data = json.loads((out / f"{name}_seed{SEED}.json").read_text())
    assert (out / f"{name}_seed{SEED}.png").stat().st_size > 10_000
    return data
