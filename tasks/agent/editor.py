"""``str_replace_editor`` over any sandbox: files are read and written whole through the sandbox's
file API, so edits are exact (no shell quoting), and every edit can be undone.

A file larger than ``MAX_FILE_BYTES`` is refused before any of it is read (its size is asked of
the sandbox first), so a huge or sparse file cannot swell the worker or the sandbox host; a read
or write the sandbox refuses (outside the workspace, read-only, too large) is an observation for
the agent, never a crash of the run."""
from __future__ import annotations

import posixpath
import shlex
from typing import Any

from tasks.agent.base import Sandbox

SNIPPET_LINES = 4
MAX_VIEW_CHARS = 16000
MAX_FILE_BYTES = 4 << 20
HISTORY_PER_FILE = 5


class EditorError(ValueError):
    """A bad editor call; its message becomes the observation."""


def _numbered(text: str, first: int = 1) -> str:
    return "\n".join(f"{n:6}\t{line}" for n, line in enumerate(text.split("\n"), start=first))


class Editor:
    def __init__(self, sandbox: Sandbox, history: dict[str, list[str]]):
        self.sandbox = sandbox
        self.history = history  # path -> earlier contents, newest last (kept in the job's state)

    def __call__(self, args: dict[str, Any]) -> str:
        command = args.get("command")
        path = args.get("path")
        if not isinstance(path, str) or not path:
            raise EditorError("`path` is required")
        handler = getattr(self, f"_{command}", None) if command in (
            "view", "create", "str_replace", "insert", "undo_edit") else None
        if handler is None:
            raise EditorError(f"unknown command {command!r}; use view, create, str_replace, insert or undo_edit")
        return handler(self._absolute(path), args)

    def _absolute(self, path: str) -> str:
        if posixpath.isabs(path):
            return posixpath.normpath(path)
        cwd = self.sandbox.exec("pwd").output.strip() or "/"
        return posixpath.normpath(posixpath.join(cwd, path))

    def _size(self, path: str) -> int | None:
        out = self.sandbox.exec(f"stat -L -c %s -- {shlex.quote(path)} 2>/dev/null").output.strip()
        return int(out) if out.isdigit() else None

    def _read(self, path: str) -> str:
        size = self._size(path)
        if size is not None and size > MAX_FILE_BYTES:
            raise EditorError(f"{path} is {size} bytes, larger than the editor's limit of "
                              f"{MAX_FILE_BYTES >> 20} MiB; look at parts of it with bash "
                              f"(head, tail, sed -n, grep) instead")
        try:
            return self.sandbox.read_file(path).decode("utf-8", errors="replace")
        except FileNotFoundError:
            raise EditorError(f"{path} does not exist") from None
        except OSError as exc:
            raise EditorError(f"cannot read {path}: {exc}") from None

    def _write(self, path: str, text: str, previous: str | None) -> None:
        if previous is not None:
            self.history.setdefault(path, []).append(previous)
            del self.history[path][:-HISTORY_PER_FILE]
        try:
            self._put(path, text)
        except EditorError:
            if previous is not None:
                self.history[path].pop()
            raise

    def _put(self, path: str, text: str) -> None:
        try:
            self.sandbox.write_file(path, text.encode())
        except OSError as exc:  # PermissionError: outside the workspace or read-only
            raise EditorError(f"cannot write {path}: {exc}. The editor writes files under the "
                              f"workspace only; use bash for other places") from None

    def _is_dir(self, path: str) -> bool:
        return self.sandbox.exec(f"test -d {shlex.quote(path)}").exit_code == 0

    def _view(self, path: str, args: dict[str, Any]) -> str:
        if self._is_dir(path):
            listing = self.sandbox.exec(f"find {shlex.quote(path)} -maxdepth 2 -not -path '*/.*' | sort | head -400")
            return f"Files and directories up to 2 levels deep in {path}:\n{listing.output}"
        lines = self._read(path).split("\n")
        first, last = 1, len(lines)
        if args.get("view_range") is not None:
            try:
                first, last = (int(x) for x in args["view_range"])
            except (TypeError, ValueError):
                raise EditorError("view_range must be two integers [first, last]") from None
            last = len(lines) if last == -1 else last
            if not 1 <= first <= max(last, 1) or last > len(lines):
                raise EditorError(f"view_range {args['view_range']} is outside the file's {len(lines)} lines")
        shown = _numbered("\n".join(lines[first - 1:last]), first)
        if len(shown) > MAX_VIEW_CHARS:
            shown = shown[:MAX_VIEW_CHARS] + "\n[... cut; use view_range to see the rest ...]"
        return f"Here is {path} (lines {first}-{last}):\n{shown}"

    def _create(self, path: str, args: dict[str, Any]) -> str:
        text = args.get("file_text")
        if not isinstance(text, str):
            raise EditorError("create needs `file_text`")
        if self.sandbox.exec(f"test -e {shlex.quote(path)}").exit_code == 0:
            raise EditorError(f"{path} already exists; edit it with str_replace or insert")
        self._write(path, text, None)
        return f"Created {path} ({len(text)} characters)."

    def _str_replace(self, path: str, args: dict[str, Any]) -> str:
        old, new = args.get("old_str"), args.get("new_str", "")
        if not isinstance(old, str) or not old:
            raise EditorError("str_replace needs a non-empty `old_str`")
        if not isinstance(new, str):
            raise EditorError("`new_str` must be a string")
        text = self._read(path)
        count = text.count(old)
        if count == 0:
            raise EditorError(f"old_str does not occur in {path} verbatim; nothing replaced")
        if count > 1:
            lines = [n for n, line in enumerate(text.split("\n"), 1) if old.split("\n")[0] in line]
            raise EditorError(f"old_str occurs {count} times in {path} (lines {lines[:10]}); make it unique")
        updated = text.replace(old, new, 1)
        self._write(path, updated, text)
        at = text[: text.index(old)].count("\n") + 1
        return f"Edited {path}. The region now reads:\n{self._snippet(updated, at, new.count(chr(10)) + 1)}"

    def _insert(self, path: str, args: dict[str, Any]) -> str:
        new, line = args.get("new_str"), args.get("insert_line")
        if not isinstance(new, str) or not isinstance(line, int) or isinstance(line, bool):
            raise EditorError("insert needs `new_str` and an integer `insert_line`")
        text = self._read(path)
        lines = text.split("\n")
        if not 0 <= line <= len(lines):
            raise EditorError(f"insert_line {line} is outside 0..{len(lines)}")
        updated = "\n".join(lines[:line] + new.split("\n") + lines[line:])
        self._write(path, updated, text)
        return f"Inserted into {path}. The region now reads:\n{self._snippet(updated, line + 1, new.count(chr(10)) + 1)}"

    def _undo_edit(self, path: str, args: dict[str, Any]) -> str:
        earlier = self.history.get(path)
        if not earlier:
            raise EditorError(f"no edit of {path} to undo")
        self._put(path, earlier[-1])
        earlier.pop()
        return f"Reverted the last edit of {path}."

    @staticmethod
    def _snippet(text: str, at: int, span: int) -> str:
        lines = text.split("\n")
        first = max(1, at - SNIPPET_LINES)
        last = min(len(lines), at + span - 1 + SNIPPET_LINES)
        return _numbered("\n".join(lines[first - 1:last]), first)
