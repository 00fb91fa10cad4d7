"""A runtime with strays, for the sweep's test: ``local`` whose "containers outside any host" are
files in ``$PRORL_TEST_STRAYS`` (name: the file's, job id: its content), stopped by deleting the
file. A stand-in for Apptainer's instances on a machine without apptainer."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sandboxes.protocol import Stray
from sandboxes.runtimes.local import LocalSandbox


def _dir() -> Path:
    return Path(os.environ["PRORL_TEST_STRAYS"])


class StrayingLocal(LocalSandbox):
    @classmethod
    def strays(cls, config: dict[str, Any] | None = None) -> list[Stray]:
        return [Stray(runtime="ignored", name=path.name, job_id=path.read_text(), started_at=path.stat().st_mtime)
                for path in sorted(_dir().iterdir())]

    @classmethod
    def stop_stray(cls, name: str, config: dict[str, Any] | None = None) -> None:
        if name.startswith("stuck"):
            raise OSError(f"{name} will not stop")
        (_dir() / name).unlink()
