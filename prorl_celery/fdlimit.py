"""Open-file limits sized to what a process holds at scale.

A sandbox host holds five descriptors per sandbox (three pipes, a pidfd, its uid's lock), a run
worker of a thousand threads one connection per thread to a sandbox host, to an inference server
and to Redis; the usual soft limit of 1024 stops both far below their capacity (EMFILE). Each
lifts its soft limit to the hard one at start; the hard limit is the operator's (``ulimit -Hn``,
systemd ``LimitNOFILE``, Slurm's propagation).
"""
from __future__ import annotations

import logging
import resource

from celery.signals import worker_init

log = logging.getLogger(__name__)


def raise_open_files_limit(needed: int = 0) -> int:
    """Lift the soft RLIMIT_NOFILE to the hard one; warn when even that is below ``needed``.
    Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    if needed and soft < needed:
        log.warning("open-file limit %d is below the %d this process may need at full load: "
                    "raise the hard limit (ulimit -Hn, systemd LimitNOFILE)", soft, needed)
    return soft


@worker_init.connect
def _worker_limits(sender=None, **_: object) -> None:
    threads = int(getattr(getattr(sender, "app", None), "conf", {}).get("worker_concurrency") or 0)
    threads = int(getattr(sender, "concurrency", 0) or threads)
    raise_open_files_limit(needed=4 * threads + 256)
