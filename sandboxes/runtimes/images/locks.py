"""The one lock a build (of an image or of a base) is made under: an exclusive ``flock``, so
every process and every node reading the same directory waits for one build, and a killed
builder holds nothing. A waiter gives up at the build's own deadline."""
from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from prorl_celery.errors import ImageBuildFailed


@contextmanager
def locked(path: Path, deadline: float, what: str) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ImageBuildFailed(f"waited for another build of {what} past the build's timeout") from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)
