"""SIF images for the singularity runtime: ``apptainer pull`` once per reference and node, into
a cache directory, under a file lock and a time limit; and the runtime's short CLI calls.

A ``docker://`` reference is first judged by the operator's registry list
(:func:`sandboxes.images.check_reference`, as bwrap's pulls are), pulled by its
canonical name, over plain HTTP only from a registry listed as insecure, and a failure is typed as
bwrap's are (``image_not_found`` / ``image_unavailable``). The cache is keyed by the reference as
given: a tag that moves keeps its first SIF until the file is removed (a digest reference never
moves). Apptainer's own layer cache is not kept (``--disable-cache``): the SIF is the cache.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
from typing import Any

from prorl_celery.errors import SandboxError
from sandboxes.runtimes.limits.netns import HELPER_ENV
from sandboxes.runtimes.procs import run_bounded


def run_cli(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """A short apptainer command; on timeout its whole process group is killed."""
    try:
        return run_bounded(argv, timeout, text=True, cwd="/",
                           env=dict(HELPER_ENV, HOME=os.path.expanduser("~")))
    except subprocess.TimeoutExpired:
        raise SandboxError(f"{' '.join(argv[:3])} took over {timeout:.0f}s") from None


# -- images -----------------------------------------------------------------------------------
def cached_image_path(cache_dir: str, ref: str) -> str:
    digest = hashlib.sha256(ref.encode()).hexdigest()[:24]
    return os.path.join(cache_dir, f"{digest}.sif")


def pull_image(binary_path: str, ref: str, cache_dir: str, timeout: float,
               options: tuple[str, ...] = (), errors=None) -> str:
    """The local .sif of ``ref``, pulled once: concurrent sandboxes wait on the same lock.
    ``errors(stderr)``: the exception for a failed pull (default: SandboxError)."""
    os.makedirs(cache_dir, exist_ok=True)
    final = cached_image_path(cache_dir, ref)
    with open(final + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(final):
            partial = f"{final}.{os.getpid()}.part"
            try:
                done = run_cli([binary_path, "--quiet", "pull", "--force", "--disable-cache",
                                *options, partial, ref], timeout)
                failure = done.stderr.strip()[-800:] if done.returncode else ""
            except SandboxError as exc:  # over its time: killed
                failure = str(exc)
            if failure or not os.path.exists(partial):
                if os.path.exists(partial):
                    os.unlink(partial)
                failure = failure or "no image file was written"
                raise errors(failure) if errors else SandboxError(f"could not pull image {ref!r}: {failure}")
            os.replace(partial, final)
    return final


def docker_pull(image: str) -> tuple[str, tuple[str, ...], Any]:
    """A ``docker://`` reference as the operator's registry list allows it (canonical), the
    pull options it needs (plain HTTP for an insecure registry) and its typed errors."""
    from sandboxes.runtimes.images.pull import classify
    from sandboxes.images import check_reference, insecure

    ref = check_reference(image)
    return ref.canonical, ("--no-https",) if insecure(ref) else (), \
        lambda stderr: classify(stderr, ref, "pulling")
