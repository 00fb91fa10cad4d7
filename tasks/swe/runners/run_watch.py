"""What the grader's test runners share: the test files read before the package loads, the code
compiled from them, and a watch on the process (standard library only; the SWE grader copies it
into the sandbox beside each runner, which loads it by path before any of the repository runs).

- :meth:`Watch.read` keeps the bytes of the test files (and their neighbours) *before* the package
  is imported: what the runner compiles from them, :meth:`Watch.index`, is the reference every
  test is held to, whatever the package does to the files on disk or to the code in memory.
- :meth:`Watch.check`, called by the runner just before it calls a test: the function about to run
  must be the one its ``def`` made. An undecorated test's ``__code__`` must equal the runner's
  compiled code for that ``def`` (the scope it is found in at run time must be the one whose source
  defines it); a decorated one's must be reachable through ``__wrapped__`` (a decorator's own
  wrapper is its code, the package's or a library's). A test no ``def`` of a read file stands for
  (imported, generated) is counted ``unchecked``, not held against the run.
- :meth:`Watch.start` installs an audit hook (audit hooks cannot be removed): setting a profile
  or trace hook (``sys.setprofile``/``settrace``, ``sys.monitoring``, an eval hook looked up
  through ``ctypes``), adding an audit hook, or assigning the ``__code__`` of a function of a read
  file is noted, unless the caller is the tests' own code or a read-only library's, as compiled
  (a library that sets a hook and leaves it is seen before the next test: :meth:`Watch.hooks_now`).

Anything noted (``hooks``) or found (``replaced``) makes the grader call the run ``unverified``.
The code under test still runs in this process: it can find this module's objects in memory;
:meth:`Watch.changed` reports this module's functions replaced.
"""
from __future__ import annotations

import builtins
import os
import sys
import types

_COMPILE = builtins.compile
_REALPATH, _GETFRAME, _ADD_AUDIT_HOOK = os.path.realpath, sys._getframe, sys.addaudithook
HOOK_EVENTS = frozenset({"sys.setprofile", "sys.settrace", "sys.monitoring.register_callback", "sys.addaudithook"})
EVAL_HOOKS = frozenset({"PyEval_SetProfile", "PyEval_SetTrace", "_PyEval_SetProfile", "_PyEval_SetTrace",
                        "PyEval_SetProfileAllThreads", "PyEval_SetTraceAllThreads", "PySys_AddAuditHook"})
WATCHED = HOOK_EVENTS | {"object.__setattr__", "ctypes.dlsym"}
MAX_FILES, MAX_BYTES = 5000, 64 << 20
CO_NEWLOCALS = 0x2  # a function's code (a class or module body has none)
NOTES = 50  # at most this many notes of each kind


class Index:
    """The code objects compiled from one file's source: ``defs`` qualname -> codes (one per
    variant: plain, and as pytest rewrites asserts), ``binds`` scope -> the names its body uses,
    ``lines`` (a ``def`` is decorated when its code starts on a line with ``@``)."""

    def __init__(self, modules: list, source: bytes) -> None:
        self.defs: dict[str, list] = {}
        self.binds: dict[str, set] = {}
        self.codes: list = []
        self.tops: list = []  # the functions and methods it defines at module and class level
        self.lines = source.decode("utf-8", "replace").splitlines()
        for module in modules:
            self._walk(module, "", "")

    def _walk(self, code, prefix: str, scope: str | None) -> None:
        if scope is not None:
            self.binds.setdefault(scope, set()).update(code.co_names)
        for const in code.co_consts:
            if not isinstance(const, types.CodeType):
                continue
            qual = prefix + const.co_name
            self.codes.append(const)
            if const.co_flags & CO_NEWLOCALS:
                self.defs.setdefault(qual, []).append(const)
                if "<locals>" not in qual:
                    self.tops.append(const)
                self._walk(const, qual + ".<locals>.", None)
            else:  # a class body
                self._walk(const, qual + ".", qual)

    def decorated(self, code) -> bool:
        line = code.co_firstlineno - 1
        return 0 <= line < len(self.lines) and self.lines[line].lstrip().startswith("@")


class Watch:
    """The sources read before the package loaded, the audit hook's notes, the checks' results."""

    def __init__(self, root: str) -> None:
        self.root = _REALPATH(root) + os.sep
        self.sources: dict[str, bytes] = {}
        self.hooks: list[str] = []
        self.replaced: list[str] = []
        self.unchecked: list[str] = []
        self.checked = 0
        self.rewrite = None  # the runner's second variant: (source, path) -> module code, or None
        self._indexes: dict[str, Index | None] = {}
        self._seen: set[str] = set()
        self._real: dict[str, str] = {}
        self._here = _REALPATH(__file__) if "__file__" in globals() else ""
        self._globals = globals()  # this module's namespace (the runners load it by path, outside sys.modules)
        self._saved = {n: v for n, v in self._globals.items() if callable(v) and not n.startswith("__")}
        self._methods = dict(vars(Watch))
        self._bytes = 0

    # -- the sources ------------------------------------------------------------------------
    def read(self, paths) -> None:
        """Keep the bytes of each ``.py`` file in ``paths`` (files, or directories read whole)."""
        for path in paths:
            if os.path.isdir(path):
                for where, dirs, files in os.walk(path):
                    dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
                    self.read(os.path.join(where, f) for f in sorted(files) if f.endswith(".py"))
            elif path.endswith(".py") and os.path.isfile(path):
                self._keep(path)

    def _keep(self, path: str) -> None:
        real = self.real(path)
        if real in self.sources or len(self.sources) >= MAX_FILES or self._bytes >= MAX_BYTES:
            return
        try:
            with open(real, "rb") as fh:
                self.sources[real] = fh.read()
        except OSError:
            return
        self._bytes += len(self.sources[real])

    def real(self, path: str) -> str:
        if path not in self._real:
            self._real[path] = _REALPATH(path)
        return self._real[path]

    def index(self, path: str | None, module=None) -> Index | None:
        """The code compiled from ``path``'s source as read (``module``: the runner's own compile
        of it), or None when it was not read (nor is a read-only library file, see :meth:`_trusted`)."""
        if not path:
            return None
        real = self.real(path)
        if real not in self._indexes:
            source = self.sources.get(real) or self._trusted(real)
            self._indexes[real] = None if source is None else self._compile(real, source, module)
        return self._indexes[real]

    def _compile(self, real: str, source: bytes, module) -> Index | None:
        modules = [module] if module is not None else []
        try:
            modules = modules or [_COMPILE(source, real, "exec", 0, True)]
            if self.rewrite is not None and real in self.sources:
                modules += [m for m in [self.rewrite(source, real)] if m is not None]
        except Exception:  # noqa: BLE001 - source that does not compile: no reference for it
            pass
        return Index(modules, source) if modules else None

    def _trusted(self, real: str) -> bytes | None:
        """A library file outside the repository that this process cannot write (the image's):
        the package cannot have changed it; its code is genuine where it equals a compile of it."""
        if real.startswith(self.root) or not real.endswith(".py") or os.access(real, os.W_OK):
            return None
        try:
            with open(real, "rb") as fh:
                return fh.read()
        except OSError:
            return None

    # -- the audit hook ---------------------------------------------------------------------
    def start(self) -> None:
        _ADD_AUDIT_HOOK(self._audit)

    def _audit(self, event: str, args: tuple) -> None:
        if event not in WATCHED:
            return
        try:
            if event == "object.__setattr__":
                if len(args) > 2 and args[1] == "__code__":
                    self._code_set(args[0], args[2])
            elif event == "ctypes.dlsym":
                if len(args) > 1 and str(args[1]) in EVAL_HOOKS:
                    self.note(f"ctypes looked up {args[1]}", self.caller())
            else:
                frame = self.caller()
                if not self.genuine(frame):
                    self.note(event, frame)
        except Exception:  # noqa: BLE001 - the hook never breaks the run
            pass

    def _code_set(self, func, new) -> None:
        """A ``__code__`` assigned to a function of a read file, from one, or to a wrapper of one."""
        files = {getattr(getattr(layer, "__code__", None), "co_filename", "") for layer in _layers(func)}
        files.add(getattr(new, "co_filename", ""))
        if any(f and self.real(f) in self.sources for f in files):
            self.note(f"__code__ of {getattr(func, '__qualname__', '?')} replaced", self.caller())

    def caller(self):
        """The first frame that is not this module's (the code that set the hook)."""
        frame = _GETFRAME(1)
        while frame is not None and self.real(frame.f_code.co_filename) == self._here:
            frame = frame.f_back
        return frame

    def genuine(self, frame) -> bool:
        """Whether ``frame`` runs code compiled from a read test file or a read-only library."""
        index = None if frame is None else self.index(frame.f_code.co_filename)
        return index is not None and any(code == frame.f_code for code in index.codes)

    def note(self, what: str, frame=None) -> None:
        where = f" ({frame.f_code.co_filename}:{frame.f_lineno})" if frame is not None else ""
        if len(self.hooks) < NOTES:
            self.hooks.append(what + where)

    def hooks_now(self) -> list[str]:
        """Profile and trace hooks in place now (this thread's, the ones threads start with, and
        ``sys.monitoring`` tools)."""
        found = [n for n, get in (("profile", sys.getprofile), ("trace", sys.gettrace)) if get() is not None]
        threading = sys.modules.get("threading")
        found += [n for n in ("_profile_hook", "_trace_hook") if getattr(threading, n, None) is not None]
        monitoring = getattr(sys, "monitoring", None)
        if monitoring is not None:
            found += [f"monitoring tool {i}" for i in range(6) if monitoring.get_tool(i) is not None]
        return found

    # -- the check before each test ---------------------------------------------------------
    def check(self, label: str, func, owners: list[tuple[str | None, str]], name: str) -> str:
        """``ok``, ``unchecked`` or ``replaced`` for the test ``label`` about to call ``func``.
        ``owners``: (file, scope qualname) of where the runner found it at run time first, then
        the rest of the scopes it could have come from (a class's bases)."""
        for hook in self.hooks_now():
            if hook not in self._seen:  # once a kind: the first test it was in place for
                self._seen.add(hook)
                self.note(f"a {hook} hook in place when {label} was called")
        try:
            verdict = self._verdict(func, owners, name)
        except Exception:  # noqa: BLE001 - an object the package made strange cannot be vouched for
            verdict = "replaced"
        if verdict == "ok":
            self.checked += 1
        elif verdict == "replaced" and len(self.replaced) < NOTES:
            self.replaced.append(label)
        elif verdict == "unchecked" and len(self.unchecked) < NOTES:
            self.unchecked.append(label)
        return verdict

    def check_case(self, test) -> str:
        """:meth:`check` for a ``unittest`` test about to run its method (found in the first class
        of its MRO that has it; a class's file is its module's)."""
        name, mro = getattr(test, "_testMethodName", ""), [k for k in type(test).__mro__ if k is not object]
        owner = next((k for k in mro if name in vars(k)), None)
        if owner is None:
            return "unchecked"

        def where(klass) -> tuple[str | None, str]:
            module = sys.modules.get(getattr(klass, "__module__", ""))
            return getattr(module, "__file__", None), getattr(klass, "__qualname__", "")
        label = f"{name} ({type(test).__module__}.{type(test).__qualname__})"
        return self.check(label, vars(owner)[name], [where(owner)] + [where(k) for k in mro if k is not owner], name)

    def _verdict(self, func, owners: list[tuple[str | None, str]], name: str) -> str:
        (path, scope), others = owners[0], owners[1:]
        index = self.index(path)
        found = index.defs.get(f"{scope}.{name}" if scope else name) if index is not None else None
        if found:
            return self._made_by(func, found, index)
        if index is None or name in index.binds.get(scope, ()):
            return "unchecked"  # not a read file's, or bound in its scope by other means
        for path, scope in others:  # put at run time where its source never put it, over a def
            other = self.index(path)
            if other is not None and other.defs.get(f"{scope}.{name}" if scope else name):
                return "replaced"
        return "unchecked"

    def _made_by(self, func, found: list, index: Index) -> str:
        """Whether ``func`` is what the ``def`` (one of ``found``) made: its own code, or, for a
        decorated ``def``, the code reached through the wrappers' ``__wrapped__``, each wrapper
        genuine where its file can vouch for it (a read file, a read-only library). A decorator
        that keeps no ``__wrapped__`` hides the function: ``unchecked``, unless what the chain
        ends at is another function's own code."""
        codes = [getattr(layer, "__code__", None) for layer in _layers(func)]
        decorated = any(index.decorated(code) for code in found)
        for code in codes:
            if any(code == f for f in found):
                return "ok"
            if not decorated:
                return "replaced"  # an undecorated def's function runs its own code, nothing else
            if code is None:
                return "unchecked"  # a callable object, not a function: nothing to follow
            if not self._wrapper_ok(code):
                return "replaced"
        inner = codes[-1] if codes else None
        index = self.index(inner.co_filename) if inner is not None else None
        if index is not None and any(inner == top for top in index.tops):
            return "replaced"  # what the wrappers lead to is another test's (or helper's) own code
        return "unchecked"

    def _wrapper_ok(self, code) -> bool:
        """A decorator's wrapper: genuine where its file is read or a read-only library's; the
        package's own (or generated) code otherwise, which only the package answers for."""
        real = self.real(code.co_filename)
        if real in self.sources or not real.startswith(self.root):
            index = self.index(real)
            return index is None or any(code == c for c in index.codes)
        return True

    def changed(self) -> list[str]:
        """This module's functions and :class:`Watch`'s methods that differ now."""
        names = [f"watch.{n}" for n, v in self._saved.items() if self._globals.get(n) is not v]
        return names + [f"Watch.{n}" for n, v in self._methods.items() if vars(Watch).get(n) is not v]

    def report(self) -> dict:
        return {"hooks": list(self.hooks), "replaced": list(self.replaced), "checked": self.checked,
                "unchecked": list(self.unchecked), "sources_read": len(self.sources)}


def dotted_paths(base: str, labels: list[str]) -> list[str]:
    """The files and directories beneath ``base`` that dotted test labels name (``pkg.test_m``,
    ``pkg.test_m.Class.test_x``, ``pkg``): a module with the other files of its directory, a
    package whole."""
    paths = []
    for label in labels:
        parts = [p for p in label.split(".") if p and not p.startswith("-")]
        for k in range(len(parts), 0, -1):
            where = os.path.join(base, *parts[:k])
            if os.path.isdir(where):
                paths.append(where)
                break
            if os.path.isfile(where + ".py"):
                folder = os.path.dirname(where)
                paths += [where + ".py"] + [os.path.join(folder, f) for f in sorted(os.listdir(folder))
                                            if f.endswith(".py")]
                break
    return paths


def _layers(func) -> list:
    """``func`` and what it wraps (``__wrapped__``, bound methods, static/class methods)."""
    layers, seen = [], set()
    while func is not None and id(func) not in seen and len(layers) < 20:
        seen.add(id(func))
        inner = getattr(func, "__func__", None)
        if inner is not None and not hasattr(func, "__code__"):
            func = inner
            continue
        layers.append(func)
        func = getattr(func, "__wrapped__", None)
    return layers
