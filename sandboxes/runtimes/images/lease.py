"""What holds an image of the cache: a sandbox's :class:`ImageLease` (a shared ``flock`` on the
image's lock file, so eviction, which needs it exclusively, passes it by) and :class:`FileLock`,
the exclusive lock of one pull or one eviction pass, waited for until a deadline."""
from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from prorl_celery.errors import ImageUnavailable
from sandboxes.images import ImageRef


@dataclass
class ImageLease:
    """An image a sandbox runs in; held (the image cannot be evicted) until :meth:`release`."""

    ref: str
    digest: str
    rootfs: str
    env: dict[str, str]
    workdir: str | None
    pulled: bool  # True: this create pulled it (or waited for a concurrent pull); False: cached
    seconds: float
    _fd: int | None = field(default=None, repr=False)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the shared flock
            self._fd = None

    def info(self) -> dict:
        return {"image_digest": self.digest, "image_cache": "pulled" if self.pulled else "hit",
                "image_s": round(self.seconds, 3)}


class FileLock:
    """An exclusive flock on ``path``, waited for until ``deadline`` (None: without end)."""

    def __init__(self, path: Path, deadline: float | None, ref: ImageRef | None):
        self.path, self.deadline, self.ref = path, deadline, ref
        self.fd: int | None = None

    def __enter__(self) -> "FileLock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | (fcntl.LOCK_NB if self.deadline else 0))
                return self
            except BlockingIOError:
                if time.monotonic() >= self.deadline:
                    os.close(self.fd)
                    name = self.ref.canonical if self.ref else self.path.name
                    raise ImageUnavailable(f"another sandbox host's pull of {name!r} did not end "
                                           "in time", field="spec.image") from None
                time.sleep(0.1)

    def __exit__(self, *exc_info) -> None:
        os.close(self.fd)
