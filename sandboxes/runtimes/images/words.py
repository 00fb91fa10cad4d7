"""Docker's word rules (pure): ``$VAR``, ``${VAR}``, ``${VAR:-x}``, ``${VAR-x}``, ``${VAR:+x}``,
``${VAR+x}``, ``${VAR:?msg}`` substituted and quotes removed (single quotes literal, the escape
character escaping the next character), as Docker does for ADD, ARG, COPY, ENV, EXPOSE, FROM,
LABEL, STOPSIGNAL, USER, VOLUME and WORKDIR. RUN, CMD and ENTRYPOINT are left to the shell."""
from __future__ import annotations

import re
from typing import Callable

from sandboxes.runtimes.images.dockerfile import Heredoc, fail

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
Lookup = Callable[[str], "str | None"]


class _Lexer:
    def __init__(self, text: str, lookup: Lookup, escape: str, where: str):
        self.text, self.lookup, self.escape, self.where = text, lookup, escape, where
        self.pos = 0

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def take(self) -> str:
        ch = self.peek()
        self.pos += 1
        return ch

    def words(self, split: bool) -> list[str]:
        out: list[str] = []
        current, started = [], False
        while self.pos < len(self.text):
            ch = self.take()
            if split and ch.isspace():
                if started:
                    out.append("".join(current))
                current, started = [], False
                continue
            started = True
            if ch == self.escape:
                nxt = self.take()
                current.append(nxt if nxt else ch)
            elif ch == "'":
                current.append(self._until("'"))
            elif ch == '"':
                current.append(self._double())
            elif ch == "$":
                current.append(self._variable())
            else:
                current.append(ch)
        if started:
            out.append("".join(current))
        return out

    def _until(self, end: str) -> str:
        found = self.text.find(end, self.pos)
        if found < 0:
            raise fail(self.where, f"unmatched {end} in {self.text!r}")
        value, self.pos = self.text[self.pos:found], found + 1
        return value

    def _double(self) -> str:
        out = []
        while True:
            ch = self.take()
            if not ch:
                raise fail(self.where, f'unmatched " in {self.text!r}')
            if ch == '"':
                return "".join(out)
            if ch == self.escape and self.peek() in ('"', "$", self.escape):
                out.append(self.take())
            elif ch == "$":
                out.append(self._variable())
            else:
                out.append(ch)

    def _variable(self) -> str:
        if self.peek() != "{":
            match = _NAME.match(self.text, self.pos)
            if not match:
                return "$"
            self.pos = match.end()
            return self.lookup(match.group()) or ""
        self.pos += 1
        match = _NAME.match(self.text, self.pos)
        if not match:
            raise fail(self.where, f"bad substitution in {self.text!r}")
        name, self.pos = match.group(), match.end()
        op = ""
        for candidate in (":-", ":+", ":?", "-", "+", "?"):
            if self.text.startswith(candidate, self.pos):
                op, self.pos = candidate, self.pos + len(candidate)
                break
        word = self._braced_word() if op else ""
        if self.take() != "}":
            raise fail(self.where, f"bad substitution in {self.text!r} (only ${{VAR}}, ${{VAR:-x}}, "
                                   "${VAR:+x}, ${VAR:?x} and their forms without ':' are supported)")
        return self._apply(name, op, word)

    def _braced_word(self) -> str:
        depth, out = 0, []
        while self.peek() and not (self.peek() == "}" and depth == 0):
            ch = self.take()
            if ch == "$":
                out.append(self._variable())
                continue
            if ch == self.escape and self.peek():
                out.append(self.take())
                continue
            depth += ch == "{"
            depth -= ch == "}"
            out.append(ch)
        return "".join(out)

    def _apply(self, name: str, op: str, word: str) -> str:
        value = self.lookup(name)
        unset_or_empty = not value if op.startswith(":") else value is None
        if op in (":-", "-"):
            return word if unset_or_empty else (value or "")
        if op in (":+", "+"):
            return "" if unset_or_empty else word
        if op in (":?", "?") and unset_or_empty:
            raise fail(self.where, f"{name}: {word or 'parameter not set'}")
        return value or ""


def words(text: str, lookup: Lookup, escape: str = "\\", where: str = "") -> list[str]:
    """``text`` split into words on unquoted whitespace, quotes removed, variables substituted."""
    return _Lexer(text, lookup, escape, where).words(split=True)


def word(text: str, lookup: Lookup, escape: str = "\\", where: str = "") -> str:
    """``text`` as one word (whitespace kept), quotes removed, variables substituted."""
    return "".join(_Lexer(text.strip(), lookup, escape, where).words(split=False))


def heredoc_text(doc: Heredoc, lookup: Lookup, escape: str = "\\", where: str = "") -> str:
    """A COPY/ADD heredoc's content: variables substituted unless its delimiter was quoted."""
    if doc.quoted:
        return doc.body
    out, lexer = [], _Lexer(doc.body, lookup, escape, where)
    while lexer.pos < len(doc.body):
        ch = lexer.take()
        if ch == escape and lexer.peek() in ("$", escape):
            out.append(lexer.take())
        else:
            out.append(lexer._variable() if ch == "$" else ch)
    return "".join(out)

