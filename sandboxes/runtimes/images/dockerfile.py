"""A Dockerfile's syntax (pure): its instructions, with line numbers, flags and heredocs, and the
word rules Docker substitutes variables by.

- Parser directives at the top (``# escape=`` honoured, ``# syntax=`` and ``# check=`` ignored);
  comment lines dropped (inside a continued instruction too), blank lines skipped, lines joined
  where they end in the escape character.
- ``<<WORD`` / ``<<-WORD`` / ``<<"WORD"`` heredocs of RUN, COPY and ADD: the lines up to ``WORD``
  (tabs stripped for ``<<-``) are the heredoc's body, taken verbatim.
- Leading ``--name=value`` flags of FROM, RUN, COPY, ADD and HEALTHCHECK are split off.
- Variable substitution is :mod:`sandboxes.runtimes.images.words`; what each instruction means
  is :mod:`sandboxes.runtimes.images.plan`.

A syntax error is :class:`ImageBuildFailed` naming the line.
"""
from __future__ import annotations

import json
import re

from pydantic import BaseModel, ConfigDict

from prorl_celery.errors import ImageBuildFailed

KNOWN = ("FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER", "SHELL", "CMD", "ENTRYPOINT",
         "EXPOSE", "LABEL", "VOLUME", "STOPSIGNAL", "HEALTHCHECK", "ONBUILD", "MAINTAINER")
FLAGGED = ("FROM", "RUN", "COPY", "ADD", "HEALTHCHECK")
HEREDOC_INSTRUCTIONS = ("RUN", "COPY", "ADD")
_DIRECTIVE = re.compile(r"^#\s*([a-zA-Z][a-zA-Z0-9_-]*)\s*=\s*(.*?)\s*$")
_HEREDOC = re.compile(r"<<(-?)\s*([\"']?)([A-Za-z_][A-Za-z0-9_.-]*)\2")
_FLAG = re.compile(r"^--([a-z][a-z-]*)(?:=(\S*))?$")


class Heredoc(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    body: str
    quoted: bool  # <<"EOF": no variable expansion in the body
    strip_tabs: bool = False


class Instruction(BaseModel):
    """One instruction: ``cmd`` upper-case, ``args`` the text after the keyword and its flags."""

    model_config = ConfigDict(extra="forbid")

    cmd: str
    args: str
    line: int
    flags: dict[str, str] = {}
    heredocs: list[Heredoc] = []

    @property
    def where(self) -> str:
        return f"line {self.line} ({self.cmd})"

    def exec_form(self) -> list[str] | None:
        """The JSON array this instruction was written as, or None (shell form)."""
        text = self.args.strip()
        if not text.startswith("["):
            return None
        try:
            value = json.loads(text)
        except ValueError:
            return None  # as Docker: not valid JSON is the shell form
        return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


class Dockerfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    escape: str = "\\"
    instructions: list[Instruction]


def fail(where: str, why: str) -> ImageBuildFailed:
    return ImageBuildFailed(f"Dockerfile {where}: {why}")


def _directives(lines: list[str]) -> tuple[str, int]:
    """(escape character, index of the first line after the directives)."""
    escape, seen = "\\", set()
    for index, line in enumerate(lines):
        match = _DIRECTIVE.match(line.strip())
        if not match or match.group(1).lower() in seen:
            return escape, index
        name, value = match.group(1).lower(), match.group(2)
        seen.add(name)
        if name == "escape":
            if value not in ("\\", "`"):
                raise fail(f"line {index + 1}", f"escape must be \\ or `, not {value!r}")
            escape = value
    return escape, len(lines)


def _continued(line: str, escape: str) -> tuple[str, bool]:
    """(the line without its trailing escape character, whether the instruction continues)."""
    stripped = line.rstrip()
    if stripped.endswith(escape):
        return stripped[:-1], True
    return line, False


def _heredocs(text: str, lines: list[str], index: int, where: str) -> tuple[list[Heredoc], int]:
    """The bodies of the heredocs ``text`` opens, read from ``lines[index:]``."""
    docs = []
    for strip, quote, name in _HEREDOC.findall(text):
        body = []
        while True:
            if index >= len(lines):
                raise fail(where, f"heredoc <<{name} is never closed (no line {name!r})")
            line = lines[index]
            index += 1
            check = line.lstrip("\t") if strip else line
            if check.rstrip("\r") == name:
                break
            body.append(check if strip else line)
        docs.append(Heredoc(name=name, body="".join(f"{b}\n" for b in body), quoted=bool(quote),
                            strip_tabs=bool(strip)))
    return docs, index


def _flags(cmd: str, rest: str, where: str) -> tuple[dict[str, str], str]:
    flags: dict[str, str] = {}
    while cmd in FLAGGED:
        rest = rest.lstrip()
        token = rest.split(None, 1)[0] if rest.strip() else ""
        match = _FLAG.match(token)
        if not token.startswith("--") or not match:
            if token.startswith("--") and token != "--":
                raise fail(where, f"malformed flag {token!r}")
            break
        flags[match.group(1)] = match.group(2) if match.group(2) is not None else "true"
        rest = rest[len(token):]
    return flags, rest.strip()


def parse(text: str) -> Dockerfile:
    """The instructions of a Dockerfile's ``text`` (syntax only; nothing is evaluated)."""
    lines = text.splitlines()
    escape, index = _directives(lines)
    out: list[Instruction] = []
    while index < len(lines):
        start, parts = index + 1, []
        while index < len(lines):
            line = lines[index]
            index += 1
            if line.strip().startswith("#") or (parts and not line.strip()):
                continue  # comments, and blank lines inside a continuation
            if not parts and not line.strip():
                continue
            if not parts:
                start = index
            body, more = _continued(line, escape)
            parts.append(body)
            if not more:
                break
        if not parts:
            break
        logical = "".join(parts).strip()
        keyword, _, rest = logical.partition(" ")
        cmd = keyword.upper()
        where = f"line {start} ({keyword})"
        if cmd not in KNOWN:
            raise fail(where, f"unknown instruction {keyword!r}")
        flags, rest = _flags(cmd, rest, where)
        docs: list[Heredoc] = []
        if cmd in HEREDOC_INSTRUCTIONS and "<<" in rest:
            docs, index = _heredocs(rest, lines, index, where)
        out.append(Instruction(cmd=cmd, args=rest, line=start, flags=flags, heredocs=docs))
    return Dockerfile(escape=escape, instructions=out)
