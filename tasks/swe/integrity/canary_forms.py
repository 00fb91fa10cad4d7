"""How canaries are made from a test file (:mod:`tasks.swe.integrity.canaries` decides which): the file's
listed tests found in its source, copied under a fresh name (changed, for a must-fail canary, at
one assertion: a constant, a negation, the exception a ``raises`` block expects), or made up in
the file's style where it offers none; and put at random places among the file's tests (a method
into its own class). Everything random comes from the caller's secret-seeded ``rng``.
"""
from __future__ import annotations

import ast
import builtins
import random
import re
from typing import NamedTuple

MAX_LINES = 80  # a longer test is not copied
NEGATIONS = {"assertTrue": "assertFalse", "assertFalse": "assertTrue", "assertIsNone": "assertIsNotNone",
             "assertIsNotNone": "assertIsNone", "assertIn": "assertNotIn", "assertNotIn": "assertIn",
             "assertIs": "assertIsNot", "assertIsNot": "assertIs", "assertEqual": "assertNotEqual",
             "assertEquals": "assertNotEqual", "assertNotEqual": "assertEqual", "assertIsInstance":
             "assertNotIsInstance", "assertNotIsInstance": "assertIsInstance"}
RAISES = {"raises", "assertRaises", "assertRaisesRegex", "assertRaisesRegexp", "assertRaisesMessage"}
# what a changed ``raises`` expects instead: exceptions code seldom raises or subclasses
OTHER_ERRORS = ("ZeroDivisionError", "RecursionError", "UnicodeDecodeError", "FileNotFoundError")
_WORD = re.compile(r"[A-Za-z_]\w*")
_QUIET = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_REFUSED = (ast.Return, ast.Yield, ast.YieldFrom, ast.Global, ast.Nonlocal, ast.Await)


class Def(NamedTuple):
    """A test ``def`` of the file (``cls``: its top-level class, or None)."""

    cls: str | None
    node: ast.FunctionDef
    owner: ast.ClassDef | None


class Made(NamedTuple):
    """A canary's source text and what it is."""

    cls: str | None
    name: str
    must: str
    form: str
    source: str | None
    lines: list[str]


class Layout:
    """A test file read for canaries: its tests, its words, where a canary may go."""

    def __init__(self, path: str, text: str) -> None:
        self.path, self.lines = path, text.split("\n")
        try:
            self.tree: ast.Module | None = ast.parse(text)
        except (SyntaxError, ValueError):
            self.tree = None
        self.defs = _test_defs(self.tree)
        self.taken = set(_WORD.findall(text))
        self.words = _words([name for _, name in self.defs] or re.findall(r"def (test_\w+)", text), self.taken)
        self.used: set[str] = set()
        self.changed: set[tuple] = set()  # (test, line, column) of each change made

    # -- which tests --------------------------------------------------------------------------
    def sources(self, listed: list[str], described: bool = False) -> list[Def]:
        """The listed tests defined in this file that can be copied (``described``: the runner's
        log names a test by its docstring, as Django's does: none with one)."""
        found = [self.defs.get(key) for key in (self._match(name) for name in listed) if key]
        return [d for d in dict.fromkeys(found) if d is not None and _copyable(d)
                and not (described and ast.get_docstring(d.node) is not None)]

    def _match(self, listed: str) -> tuple[str | None, str] | None:
        """(class, name) of a listed test of this file: a pytest node id, Django's and unittest's
        ``name (module.Class)``, a dotted unittest id, or SymPy's bare name."""
        module = self.path[:-3].replace("/", ".")
        modules, text = (module, re.sub(r"^tests\.", "", module)), listed.strip()
        if text.startswith(self.path + "::"):
            parts = text[len(self.path) + 2:].split("::")
            return None if "[" in parts[-1] or len(parts) > 2 else ((parts[0] if len(parts) == 2 else None), parts[-1])
        found = re.fullmatch(r"(\w+) \(([\w.]+)\)", text)
        if found:
            name, dotted = found.groups()
            dotted = dotted[:-len(name) - 1] if dotted.endswith("." + name) else dotted
            return next(((dotted[len(m) + 1:], name) for m in modules
                         if dotted.startswith(m + ".") and "." not in dotted[len(m) + 1:]), None)
        if text.startswith(module + "."):
            rest = text[len(module) + 1:].split(".")
            return (rest[0], rest[1]) if len(rest) == 2 else ((None, rest[0]) if len(rest) == 1 else None)
        return (None, text) if re.fullmatch(r"test\w*", text) else None

    def uses_raises(self) -> bool:
        """Whether the file checks with SymPy's ``raises`` (imported from its test helpers)."""
        return bool(re.search(r"^from\s+[\w.]+\s+import\s+(?:\([^)]*|[^\n]*)\braises\b", "\n".join(self.lines), re.M))

    # -- canaries -----------------------------------------------------------------------------
    def copy(self, rng: random.Random, source: Def) -> tuple[Made, tuple[int, str]]:
        """A must-pass canary: ``source`` as it is, renamed."""
        name = self.fresh(rng)
        return (Made(source.cls, name, "pass", "copy", source.node.name, self._clone(source, name)),
                self._spot(rng, source.cls, source))

    def mutant(self, rng: random.Random, source: Def, raises_first: bool = False
               ) -> tuple[Made | None, tuple[int, str]]:
        """A must-fail canary: ``source`` renamed, with one change that cannot pass where it passes."""
        changes = [c for c in _changes(source.node, rng) if c is not None and _key(source, c[1]) not in self.changed]
        if raises_first:
            changes = [c for c in changes if c[0] == "raises"]
        plain = self._clone(source, source.node.name)
        for form, node, replacement in rng.sample(changes, len(changes)):
            lines = self._clone(source, source.node.name, (node, replacement))
            if lines != plain:  # a change the source's text could not take is no change
                self.changed.add(_key(source, node))  # never twice: two equal copies would be each other's twin
                name = self.fresh(rng)
                lines[0] = re.sub(rf"\bdef\s+{re.escape(source.node.name)}\s*\(", f"def {name}(", lines[0], count=1)
                return Made(source.cls, name, "fail", form, source.node.name, lines), self._spot(rng, source.cls, source)
        return None, (0, "")

    def synthetic(self, rng: random.Random, must: str, raises: bool = False) -> tuple[Made | None, tuple[int, str]]:
        """A canary made up in the file's style (where it offers no listed test to copy): a test
        function, or a ``unittest.TestCase`` class where its tests are all methods."""
        name, word = self.fresh(rng), rng.choice(self.words)
        fail = must == "fail"
        if raises:
            body = [f"raises({rng.choice(OTHER_ERRORS)}, lambda: len({word!r}) // {rng.randint(1, 9)})"]
        else:
            body = _made_up(rng, word, fail)
        methods = any(d.cls for d in self.defs.values()) and not any(d.cls is None for d in self.defs.values())
        if not methods:
            return Made(None, name, must, "synthetic", None, [f"def {name}():"] + [f"    {b}" for b in body]), (
                self._spot(rng, None))
        cls = "Test" + "".join(w.capitalize() for w in rng.sample(self.words, min(2, len(self.words))))
        while cls in self.taken:
            cls += rng.choice(self.words).capitalize()
        self.taken.add(cls)
        checks = [re.sub(r"^assert (.*) == (.*)$", r"self.assertEqual(\1, \2)", b) for b in body]
        lines = ["import unittest", "", "", f"class {cls}(unittest.TestCase):", f"    def {name}(self):"]
        return Made(cls, name, must, "synthetic", None, lines + [f"        {c}" for c in checks]), (len(self.lines), "eof")

    def fresh(self, rng: random.Random) -> str:
        """A test name of one to three of the file's words, in no use in it yet."""
        for tries in range(200):
            picked = rng.sample(self.words, min(len(self.words), rng.choice((1, 2, 2, 3)) + tries // 50))
            name = "test_" + "_".join(picked)
            if name not in self.taken and name not in self.used:
                self.used.add(name)
                return name
        while True:  # a file of few words: a number after them, never one in use (a second def shadows the first)
            name = f"test_{'_'.join(rng.sample(self.words, min(3, len(self.words))))}_{rng.randint(2, 999)}"
            if name not in self.taken and name not in self.used:
                self.used.add(name)
                return name

    # -- where they go --------------------------------------------------------------------------
    def _spot(self, rng: random.Random, cls: str | None, near: Def | None = None) -> tuple[int, str]:
        """(the line index a canary goes before, how): among the file's tests, or in ``cls``; for a
        copy, before or after its source with even odds (the copy's rank among its twins says
        nothing), anywhere on that side."""
        spots = self._top_spots() if cls is None else self._class_spots(cls)
        if near is not None:
            at = _start(near.node) - 1
            sides = [side for side in ([s for s in spots if s[0] <= at], [s for s in spots if s[0] > at]) if side]
            spots = rng.choice(sides)
        return rng.choice(spots)

    def _top_spots(self) -> list[tuple[int, str]]:
        """The spots among the file's top-level tests: before each function or class from the
        first test function on, and the end of the file."""
        first = min((d.node.lineno for d in self.defs.values() if d.cls is None), default=1)
        starts = [_start(n) for n in self.tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                  and n.lineno >= first] if self.tree else []
        return [(s - 1, "top") for s in starts] + [(len(self.lines), "eof")]

    def _class_spots(self, cls: str) -> list[tuple[int, str]]:
        """The spots in the class ``cls``: before each of its methods, and at its end."""
        owner = next(d.owner for d in self.defs.values() if d.cls == cls)
        spots = [(_start(n) - 1, "method") for n in owner.body if isinstance(n, ast.FunctionDef)]
        spots.append((owner.end_lineno, "class-end"))
        return spots

    def insert(self, rng: random.Random, made: list[tuple[Made, tuple[int, str]]]) -> str:
        """The file's text with each canary at its spot (those at one spot in a random order)."""
        lines = list(self.lines)
        order = sorted(made, key=lambda item: (item[1][0], rng.random()), reverse=True)
        for canary, (index, how) in order:
            block = {"top": canary.lines + ["", ""], "method": canary.lines + [""],
                     "class-end": [""] + canary.lines, "eof": ["", ""] + canary.lines + [""]}[how]
            lines[index:index] = block
        return "\n".join(lines)

    def _clone(self, source: Def, name: str, change: tuple[ast.AST, str] | None = None) -> list[str]:
        node = source.node
        lines = self.lines[node.lineno - 1:node.end_lineno]
        if change is not None:
            lines = _replace(lines, node.lineno, *change)
        lines[0] = re.sub(rf"\bdef\s+{re.escape(node.name)}\s*\(", f"def {name}(", lines[0], count=1)
        return lines


def _test_defs(tree: ast.Module | None) -> dict[tuple[str | None, str], Def]:
    """(class, name) -> the file's test functions and the test methods of its top-level classes."""
    defs: dict[tuple[str | None, str], Def] = {}
    for node in tree.body if tree else []:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            defs[(None, node.name)] = Def(None, node, None)
        elif isinstance(node, ast.ClassDef):
            defs.update({(node.name, sub.name): Def(node.name, sub, node) for sub in node.body
                         if isinstance(sub, ast.FunctionDef) and sub.name.startswith("test")})
    return defs


def _words(names: list[str], identifiers: set[str]) -> list[str]:
    """The words of the file's test names (its identifiers' where it has none)."""
    words = {w for n in names for w in n.split("_")[1:] if len(w) > 2 and w.isalpha()}
    return sorted(words) or sorted({w.lower() for w in identifiers if len(w) > 3 and w.isalpha()})[:40] or ["value", "case"]


def _key(source: Def, node: ast.AST) -> tuple:
    return source.cls, source.node.name, node.lineno, node.col_offset


def _start(node: ast.AST) -> int:
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def _own(node: ast.AST):
    """The nodes of a function's own body (not of what it defines)."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, _QUIET):
            yield from _own(child)


def _copyable(d: Def) -> bool:
    """A plain test that runs every top-level statement when it passes: no decorator (on it or its
    class), not async, no
    ``return``/``yield``/``global``, not too long (its arguments are its runner's to fill: a
    listed test is one its runner can call)."""
    node = d.node
    if node.decorator_list or (d.owner is not None and d.owner.decorator_list):
        return False
    return node.end_lineno - node.lineno <= MAX_LINES and not any(isinstance(n, _REFUSED) for n in _own(node))


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else (func.id if isinstance(func, ast.Name) else "")


def _changes(node: ast.FunctionDef, rng: random.Random) -> list[tuple[str, ast.AST, str] | None]:
    """(form, the node to replace, its replacement) for each change of a top-level statement."""
    out: list[tuple[str, ast.AST, str] | None] = []
    for stmt in node.body:
        if isinstance(stmt, ast.Assert):
            out += [_literal(stmt.test, rng), ("negated", stmt.test, "")]
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            out += _call_changes(stmt.value, rng)
        elif isinstance(stmt, ast.With) and isinstance(stmt.items[0].context_expr, ast.Call):
            call = stmt.items[0].context_expr
            if _callee(call) in RAISES and call.args:
                out.append(_raises(call.args[0], rng))
    return out


def _call_changes(call: ast.Call, rng: random.Random) -> list[tuple[str, ast.AST, str] | None]:
    """The changes of an assertion method's call (``self.assertEqual(...)``, ``raises(...)``)."""
    name, out = _callee(call), []
    if name in ("assertEqual", "assertEquals"):
        out += [_literal(arg, rng) for arg in call.args[:2]]
    if name in NEGATIONS and isinstance(call.func, ast.Attribute):
        out.append(("negated", call.func, NEGATIONS[name]))
    if name in RAISES and call.args:
        out.append(_raises(call.args[0], rng))
    return out


def _literal(test: ast.AST, rng: random.Random) -> tuple[str, ast.AST, str] | None:
    """A constant of ``a == <constant>`` (or an ``assertEqual`` argument) and another in its place."""
    if isinstance(test, ast.Compare):
        if len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
            return None
        test = next((side for side in (test.comparators[0], test.left) if isinstance(side, ast.Constant)), None)
    if not isinstance(test, ast.Constant) or isinstance(test.value, bool):
        return None
    other = _other_constant(test.value, rng)
    return None if other is None else ("literal", test, other)


def _other_constant(value: object, rng: random.Random) -> str | None:
    """The text of a constant that differs from ``value`` (an int, a float, a short plain string),
    or None for any other."""
    if isinstance(value, int):
        return str(value + rng.choice((1, 2, 3, 7)))
    if isinstance(value, float):
        return repr(value + rng.choice((1.0, 0.5, 2.0)))
    if isinstance(value, str) and value.isprintable() and "\\" not in value and len(value) < 200:
        chars = "abcdefghijklmnopqrstuvwxyz0123456789"
        at = rng.randrange(len(value) + 1)
        new = value[:at] + rng.choice([c for c in chars if value[at:at + 1] != c]) + value[at + 1:]
        return "<str>" + new  # quoted as the original (see _replace)
    return None


def _raises(arg: ast.AST, rng: random.Random) -> tuple[str, ast.AST, str] | None:
    """The exception a ``raises`` expects, swapped for one it cannot catch where the test passes
    (none where it expects a builtin that catches them all)."""
    expected = getattr(builtins, arg.id, None) if isinstance(arg, ast.Name) else None
    others = [e for e in OTHER_ERRORS if not (isinstance(expected, type) and issubclass(getattr(builtins, e), expected))
              and e != getattr(arg, "id", None)]
    return ("raises", arg, rng.choice(others)) if others else None


def _made_up(rng: random.Random, word: str, fail: bool) -> list[str]:
    """A made-up check on plain values (the file's words, random numbers)."""
    a, b, c = rng.sample(range(2, 40), 3)
    off = rng.choice((1, 2, 5)) if fail else 0
    forms = [[f"values = [{a}, {b}, {c}]", f"assert sorted(values)[-1] == {max(a, b, c) + off}"],
             [f"word = {word!r}", f"assert len(word) == {len(word) + off}"],
             [f"total = sum([{a}, {b}])", f"assert total == {a + b + off}"],
             [f"assert {word!r}.upper() == {(word.upper() + ('X' if fail else ''))!r}"]]
    return rng.choice(forms)


def _replace(lines: list[str], first_line: int, node: ast.AST, replacement: str) -> list[str]:
    """``lines`` (the file's from line ``first_line``) with ``node``'s text replaced: by
    ``replacement``; a negated assertion by its negation; a string by ``<str>``'s text in the
    original's quotes."""
    (l0, c0), (l1, c1) = _chars(lines, first_line, node)
    old = "\n".join([lines[l0][c0:]] + lines[l0 + 1:l1] + [lines[l1][:c1]]) if l1 > l0 else lines[l0][c0:c1]
    if replacement.startswith("<str>"):
        quote = old[:1] if old[:1] in "'\"" and old[-1:] == old[:1] and not old.startswith(old[:1] * 3) else None
        if quote is None or quote in replacement:
            return lines  # a prefixed, triple-quoted or escaped string: left alone
        replacement = quote + replacement[5:] + quote
    elif replacement == "":  # a negated assert: `not X` loses its `not`, anything else gains one
        operand = node.operand if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) else None
        replacement = _text(lines, first_line, operand) if operand is not None else f"not ({old})"
    elif isinstance(node, ast.Attribute):  # self.assertX -> self.assertNotX
        replacement = old[:len(old) - len(node.attr)] + replacement
    head, tail = lines[l0][:c0], lines[l1][c1:]
    return lines[:l0] + (head + replacement + tail).split("\n") + lines[l1 + 1:]


def _chars(lines: list[str], first_line: int, node: ast.AST) -> tuple[tuple[int, int], tuple[int, int]]:
    """``node``'s start and end as (line in ``lines``, character) (ast counts UTF-8 bytes)."""
    l0, l1 = node.lineno - first_line, node.end_lineno - first_line

    def char(line: str, offset: int) -> int:
        return len(line.encode("utf-8")[:offset].decode("utf-8", "ignore"))
    return (l0, char(lines[l0], node.col_offset)), (l1, char(lines[l1], node.end_col_offset))


def _text(lines: list[str], first_line: int, node: ast.AST) -> str:
    (l0, c0), (l1, c1) = _chars(lines, first_line, node)
    if l0 == l1:
        return lines[l0][c0:c1]
    return "\n".join([lines[l0][c0:]] + lines[l0 + 1:l1] + [lines[l1][:c1]])
