"""``DummySandbox``: the agent's ``Sandbox`` in process, for unit tests of the loop and the editor.

Files live in a dict, with the path rules of a real runtime's workspace
(:class:`sandboxes.runtimes.workspace.Workspace`: relative to the workspace or absolute inside it, ``..``
and anything outside refused with PermissionError, FileNotFoundError for a missing file,
parents made on write). ``exec`` answers the few shell commands the editor sends (``pwd``,
``cd``, ``test -e|-f|-d``, ``stat -L -c %s``) from that dict, and any other command from the
rules a test adds with :meth:`on` (first match wins), else exit 127 as bash would. Every
command is kept in ``commands`` with its timeout; ``interrupts`` and ``closed`` count what the
stage asked of the sandbox itself, and ``stat`` answers for the files in the dict. ``tests/tasks/test_agent_loop.py`` runs the
same editor session here and on the real ``local`` runtime and compares the observations.
"""
from __future__ import annotations

import errno
import posixpath
import re
import shlex
from collections.abc import Callable
from typing import Union

from sandboxes.base import ExecResult
from sandboxes.protocol import StatResult
from sandboxes.runtimes.workspace import Workspace

Answer = Union[str, ExecResult, Callable[[str], ExecResult]]


def ok(output: str = "") -> ExecResult:
    return ExecResult(output=output, exit_code=0)


def failed(output: str = "", exit_code: int = 1) -> ExecResult:
    return ExecResult(output=output, exit_code=exit_code)


def timed_out(output: str = "", after_s: float = 0.0) -> ExecResult:
    """What a runtime returns for a command it killed at its timeout (no exit status)."""
    return ExecResult(output=output, exit_code=None, timed_out=True, duration_s=after_s)


class DummySandbox:
    def __init__(self, files: dict[str, str | bytes] | None = None, workspace: str = "/workspace"):
        self.root = Workspace("/nonexistent", workspace)  # its path rules only; nothing is opened
        self.files: dict[str, bytes] = {}
        self.cwd = self.root.mount
        self.commands: list[tuple[str, float | None]] = []
        self.interrupts = 0
        self.closed = False
        self._rules: list[tuple[re.Pattern[str], Answer]] = []
        for path, data in (files or {}).items():
            self.write_file(path, data.encode() if isinstance(data, str) else data)

    def on(self, pattern: str, answer: Answer) -> "DummySandbox":
        """Answer commands matching the regular expression ``pattern`` (``re.search``)."""
        self._rules.append((re.compile(pattern), answer))
        return self

    # -- files --------------------------------------------------------------------------------
    def _key(self, path: str) -> str:
        parts = self.root.relative(path)
        if not parts:
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        return "/".join(parts)

    def _is_dir(self, key: str) -> bool:
        return key == "" or any(name.startswith(key + "/") for name in self.files)

    def read_file(self, path: str) -> bytes:
        key = self._key(path)
        if key in self.files:
            return self.files[key]
        if self._is_dir(key):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)

    def write_file(self, path: str, data: bytes) -> None:
        key = self._key(path)
        if self._is_dir(key):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        self.files[key] = bytes(data)

    def stat(self, path: str) -> StatResult:
        key = self._key(path)
        if key in self.files:
            return StatResult(path=path, kind="file", size=len(self.files[key]), mode=0o644, mtime=0.0)
        if self._is_dir(key):
            return StatResult(path=path, kind="dir", size=0, mode=0o755, mtime=0.0)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)

    def interrupt(self) -> None:
        """What a stage delivered again asks first (a dead worker's command may still run)."""
        self.interrupts += 1

    def close(self) -> None:
        self.closed = True

    # -- commands -----------------------------------------------------------------------------
    def exec(self, command: str, timeout: float | None = None) -> ExecResult:
        self.commands.append((command, timeout))
        for pattern, answer in self._rules:
            if pattern.search(command):
                return answer(command) if callable(answer) else ok(answer) if isinstance(answer, str) else answer
        return self._builtin(command)

    def _builtin(self, command: str) -> ExecResult:
        words = shlex.split(command.replace("2>/dev/null", ""))
        if words == ["pwd"]:
            return ok(self.cwd + "\n")
        if len(words) == 2 and words[0] == "cd":
            return self._cd(words[1])
        if len(words) == 3 and words[0] == "test" and words[1] in ("-e", "-f", "-d"):
            return ok() if self._test(words[1], words[2]) else failed()
        if words[:4] == ["stat", "-L", "-c", "%s"] and len(words) in (5, 6):
            size = self._size(words[-1])
            quiet = "2>/dev/null" in command
            missing = "" if quiet else f"stat: cannot statx '{words[-1]}': No such file or directory\n"
            return failed(missing) if size is None else ok(f"{size}\n")
        return failed(f"bash: {words[0] if words else command}: command not found\n", 127)

    def _where(self, path: str) -> str | None:
        """The workspace key of ``path`` (relative to the shell's directory), None outside it."""
        try:
            return "/".join(self.root.relative(posixpath.normpath(posixpath.join(self.cwd, path))))
        except PermissionError:
            return None

    def _test(self, flag: str, path: str) -> bool:
        key = self._where(path)
        if key is None:
            return False
        is_file, is_dir = key in self.files, self._is_dir(key)
        return {"-e": is_file or is_dir, "-f": is_file, "-d": is_dir}[flag]

    def _size(self, path: str) -> int | None:
        key = self._where(path)
        return None if key is None or key not in self.files else len(self.files[key])

    def _cd(self, path: str) -> ExecResult:
        key = self._where(path)
        if key is None or not self._is_dir(key):
            return failed(f"bash: cd: {path}: No such file or directory\n")
        self.cwd = posixpath.join(self.root.mount, key) if key else self.root.mount
        return ok()
