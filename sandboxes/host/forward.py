"""Ports of one sandbox reached from another of the same job, on this host: a Harbor task's
sidecar service (its own sandbox, its own network) answering the agent at ``127.0.0.1:PORT``
in the agent's namespace, the agent getting no route through the sidecar's interface.

Each :class:`Forward` is one helper process (:mod:`sandboxes.runtimes.limits.forward`, standard
library, run by this host's Python): listeners made in the listening sandbox's namespace, each
connection spliced to the same port in the target's. It ends when closed, with either sandbox
(the pool closes it), or when this host dies (its exit pipe's write end is this process's only).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from prorl_celery.errors import SandboxError
from prorl_celery.spawn import spawn
from sandboxes.runtimes.limits.netns import HELPER_ENV
from sandboxes.runtimes.procs import readable

HELPER = Path(__file__).resolve().parents[1] / "runtimes" / "limits" / "forward.py"
READY_TIMEOUT_S = 10.0


class Forward:
    """``ports`` of the namespace ``target_ns`` listened on in ``listen_ns`` (descriptors the
    caller keeps and closes); returned once every listener is bound."""

    def __init__(self, listen_ns: int, target_ns: int, ports: list[int]):
        self.ports = list(ports)
        ready_r, ready_w = os.pipe()
        exit_r, self._exit_w = os.pipe()  # only this process holds the write end
        spec = {"listen_fd": listen_ns, "target_fd": target_ns, "ports": self.ports,
                "ready_fd": ready_w, "exit_fd": exit_r}
        log = tempfile.TemporaryFile()
        try:
            self.proc = spawn([sys.executable, "-I", str(HELPER), json.dumps(spec)],
                              pass_fds=(listen_ns, target_ns, ready_w, exit_r), stdin=subprocess.DEVNULL,
                              stdout=log, stderr=log, env=HELPER_ENV, cwd="/", start_new_session=True)
        except BaseException:
            for fd in (ready_r, ready_w, exit_r, self._exit_w):
                os.close(fd)
            log.close()
            raise
        os.close(ready_w)
        os.close(exit_r)
        try:
            said = os.read(ready_r, 1000) if readable((ready_r,), READY_TIMEOUT_S) else b""
            if said != b"1":
                self.close()
                log.seek(0)
                raise SandboxError(f"forwarding ports {self.ports} failed: "
                                   f"{(said or log.read()[-800:]).decode(errors='replace') or 'no answer'}")
        finally:
            os.close(ready_r)
            log.close()

    def close(self) -> None:
        """End the helper (its exit pipe closed, then SIGKILL if it lingers). Idempotent."""
        if self._exit_w is not None:
            os.close(self._exit_w)
            self._exit_w = None
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


def forward(listen: object, target: object, ports: list[int]) -> Forward:
    """A :class:`Forward` between two running sandboxes (their runtimes' ``netns_fd``)."""
    fds = []
    try:
        for box in (listen, target):
            fd = box.netns_fd()  # type: ignore[attr-defined]
            if fd is None:
                raise SandboxError(f"a {type(box).__name__} sandbox has no network namespace of its own to forward")
            fds.append(fd)
        return Forward(fds[0], fds[1], ports)
    finally:
        for fd in fds:
            os.close(fd)
