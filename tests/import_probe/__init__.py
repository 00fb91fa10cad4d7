"""Modules that show when they are imported (they write the file named by ``PRORL_TEST_IMPORT_MARK``):
tests/flask_api/test_hostile_requests.py checks that naming them in a request imports none but the
handler."""
from __future__ import annotations

import os
from pathlib import Path


def mark(module: str) -> None:
    """Append ``module`` to the mark file, if the environment names one."""
    if path := os.environ.get("PRORL_TEST_IMPORT_MARK"):
        with Path(path).open("a") as out:
            out.write(module + "\n")
