"""Small helpers several test packages share."""
from __future__ import annotations

import shlex
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path


def reachable_tmpdir(prefix: str) -> Iterator[Path]:
    """A scratch directory that sandbox uids can traverse (pytest's tmp_path is 0700), removed
    afterwards whoever wrote into it; ``yield from`` it in a fixture."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o711)
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=value words of a shell env file (what the launchers and Slurm scripts write)."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            for word in shlex.split(line):
                key, _, value = word.partition("=")
                values[key] = value
    return values


def dead(proc) -> bool:
    """A ``psutil.Process`` gone or a zombie; one that exits between the two questions is gone."""
    import psutil

    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
