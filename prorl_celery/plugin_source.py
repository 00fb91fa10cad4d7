"""A plug-in's class read from its source, before anything is imported.

A request names a handler or a runtime by dotted path; importing that module runs whatever it
runs at import (``sandboxes.host.__main__`` starts a CLI and raises ``SystemExit``). So the module
is found without importing it or its packages (the finders only, as ``importlib`` would search),
parsed, and the class is looked for in it: defined at top level, or imported there by name from a
module that defines it. The names its body defines, with those its bases define where the bases
can be found the same way, say whether it has what its family requires (a handler's ``init``,
``run``, ``eval``) before the module is imported. ``__main__`` modules are refused outright.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import sys
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path

from prorl_celery.errors import UnknownPlugin

_MAX_DEPTH = 8  # base classes followed through at most this many modules


def find_spec(module: str) -> ModuleSpec | None:
    """Where ``module`` would be loaded from, without importing it or any package above it."""
    parts = module.split(".")
    spec = _loaded_spec(parts[0]) or importlib.util.find_spec(parts[0])  # top level: no import
    for i in range(1, len(parts)):
        if spec is None or not spec.submodule_search_locations:
            return None
        name = ".".join(parts[: i + 1])
        spec = _loaded_spec(name) or PathFinder.find_spec(name, list(spec.submodule_search_locations))
    return spec


def _loaded_spec(name: str) -> ModuleSpec | None:
    module = sys.modules.get(name)
    return getattr(module, "__spec__", None) if module is not None else None


def class_members(module: str, attr: str, what: str) -> set[str]:
    """The names class ``attr`` of ``module`` defines or inherits from bases found in source;
    :class:`UnknownPlugin` when the source shows no such class (nothing is imported)."""
    parts = module.split(".")
    if "__main__" in parts or not all(p.isidentifier() for p in parts) or not attr.isidentifier():
        raise UnknownPlugin(f"cannot load {what} '{module}:{attr}': a plug-in is a class of an importable "
                            "module (never a __main__ module, which runs a program when imported)")
    if _source(module) is None:
        raise UnknownPlugin(f"cannot load {what} '{module}:{attr}': no Python source module {module!r} found")
    found = _resolve(module, attr, 0)
    if found is None:
        raise UnknownPlugin(f"cannot load {what} '{module}:{attr}': {module!r} defines no class {attr!r} "
                            "at its top level")
    return _members(*found, depth=0)


@functools.lru_cache(maxsize=512)
def _parsed(origin: str, mtime_ns: int) -> ast.Module | None:
    try:
        return ast.parse(Path(origin).read_text(encoding="utf-8"), filename=origin)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None


def _source(module: str) -> tuple[ast.Module, bool] | None:
    """The parsed source of ``module`` and whether it is a package; None if it has no .py source."""
    try:
        spec = find_spec(module)
    except (ImportError, ValueError):
        return None
    origin = spec.origin if spec is not None else None
    if not origin or not spec.has_location or not origin.endswith(".py"):
        return None
    try:
        tree = _parsed(origin, Path(origin).stat().st_mtime_ns)
    except OSError:
        return None
    return (tree, spec.submodule_search_locations is not None) if tree is not None else None


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _resolve(module: str, name: str, depth: int) -> tuple[str, ast.ClassDef] | None:
    """The class that ``name`` is bound to at the top level of ``module`` (the last binding, as at
    run time), following ``from x import name``; None when the source does not show one."""
    source = _source(module) if depth <= _MAX_DEPTH else None
    if source is None:
        return None
    tree, is_package = source
    binding: tuple | None = None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            binding = ("class", node)
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    binding = ("from", _absolute(module, is_package, node), alias.name)
        elif name in _assigned(node):
            binding = None  # bound to something the source does not show as a class
    if binding is None:
        return None
    if binding[0] == "class":
        return module, binding[1]
    return _resolve(binding[1], binding[2], depth + 1)


def _assigned(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return {node.name}
    if isinstance(node, ast.Import):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
        if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
    return {t.id for t in targets if isinstance(t, ast.Name)}


def _members(module: str, node: ast.ClassDef, depth: int) -> set[str]:
    names = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for stmt in node.body:
        names |= _assigned(stmt) if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else set()
    for base in node.bases:
        ref = _base_ref(module, base)
        found = _resolve(*ref, depth + 1) if ref else None
        if found is not None and depth < _MAX_DEPTH:
            names |= _members(*found, depth=depth + 1)
    return names


def _base_ref(module: str, base: ast.expr) -> tuple[str, str] | None:
    """(module, name) a base class expression refers to: ``Name`` in this module, or
    ``alias.Name`` / ``pkg.mod.Name`` through a top-level ``import``."""
    if isinstance(base, ast.Name):
        return module, base.id
    chain: list[str] = []
    while isinstance(base, ast.Attribute):
        chain.insert(0, base.attr)
        base = base.value
    if not isinstance(base, ast.Name) or not chain:
        return None
    target = _imported_module(module, base.id)
    return (".".join([target, *chain[:-1]]), chain[-1]) if target else None


def _imported_module(module: str, local: str) -> str | None:
    """The module a top-level ``import`` (or ``from pkg import mod``) binds ``local`` to."""
    source = _source(module)
    if source is None:
        return None
    tree, is_package = source
    bound = None
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname == local:
                    bound = alias.name
                elif alias.asname is None and alias.name.split(".")[0] == local:
                    bound = local
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == local:
                    bound = f"{_absolute(module, is_package, node)}.{alias.name}"
    return bound
