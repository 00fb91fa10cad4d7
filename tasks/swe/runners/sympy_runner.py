"""Runs SymPy's tests as ``bin/test`` does, with the grader's own code (standard library only; the
SWE grader copies it into the sandbox in place of ``bin/test``).

    python sympy_runner.py NONCE_FILE ROOT [bin/test's options and paths]   (in the repository's root)

``bin/test`` calls ``sympy.test`` (``sympy/testing/runtests.py``): the collector, the loop and the
reporter whose lines the log is read from are all package code, which a patch can replace in
process once ``sympy`` is imported. This script does their work itself:

- the test files are chosen as SymPy's runner chooses them (``test_*.py`` beneath ``sympy/``,
  kept where a path argument is a substring of the file's path or matches its name) and *read
  before any of the repository is imported*: a package that rewrites a test file when it is
  imported changes nothing that runs (and is reported: ``rewritten``);
- each file is compiled before the package loads and executed in a fresh namespace with the
  ``exec`` saved then (a replaced ``compile`` cannot strip the asserts); the watch of
  :mod:`tasks.swe.runners.run_watch` (copied beside this script) checks each test function, just
  before it is called, against that code, and notes a profile or trace hook or a replaced
  ``__code__`` (the report's ``hooks`` and ``replaced``); its ``test_*``
  functions defined in that file are run in source order, each after ``random.seed(seed)`` and
  with SymPy's deprecation warnings turned into errors, as SymPy's runner does (``-C`` sets
  ``SYMPY_USE_CACHE=no``, ``-t`` ``SYMPY_GROUND_TYPES``, ``--slow``, ``-k``, ``--seed``,
  ``--timeout`` are read as ``bin/test`` reads them; other options are ignored and listed);
- each outcome is judged by the exception the test raised (``AssertionError`` fails, an
  exception named ``Skipped``/``XFail``/``XPass`` skips or is an expected failure/unexpected
  pass, as SymPy's decorators raise them, anything else errs) and printed in the form of
  SymPy's verbose reporter (``test_name ok``, ``F``, ``E``, ``f``, ``X``, ``s``), which
  SWE-bench's SymPy parser reads;
- the repository's root is not first on ``sys.path`` (a script's own directory is, and it is
  dropped; the root goes last), yet ``sympy`` is the repository's own package (loaded from
  ``ROOT/sympy`` by path, as ``bin/test`` would find it first), whatever else is installed;
- at the end one line ``<nonce> <json>`` (on a copy of stdout taken before the package loaded)
  gives every test's outcome and ``changed``: the names of this script and of ``builtins`` the
  package replaced; then the process ends with the saved ``os._exit`` (no ``atexit`` hook of the
  package runs after it).

The grader cross-checks the log's passes with this record. The code under test still runs in this
process: it can find this module's objects in memory; canaries catch a blanket forgery.
"""
from __future__ import annotations

import argparse
import builtins
import fnmatch
import hashlib
import json
import os
import random
import sys
import time
import traceback
import warnings

_EXIT = os._exit  # the package may replace os._exit (to let its atexit hooks run)
_COMPILE, _EXEC, _ASSERTION = builtins.compile, builtins.exec, AssertionError
_BUILTINS = ("compile", "exec", "print", "AssertionError", "BaseException", "Exception", "isinstance", "getattr", "hasattr")
_CATCH, _FILTER = warnings.catch_warnings, warnings.filterwarnings
BLACKLIST = (os.path.normpath("sympy/integrals/rubi/rubi_tests/tests"),)  # _test's default blacklist
VALUED = ("--tb", "--split", "--rerun")  # bin/test options that take a value and change no outcome
FLAGS = ("--pdb", "--no-colors", "--force-colors", "--no-subprocess", "-E", "--enhance-asserts", "--fail-on-timeout")


class Skipped(Exception):
    """A slow test without ``--slow``, or one past ``--timeout`` (named as SymPy's own)."""


class Stop(Exception):
    """A test ended the whole run (``SystemExit``, ``KeyboardInterrupt``), as it ends SymPy's."""


def options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """bin/test's options, and its paths (its unknown arguments are paths too)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("-C", "--no-cache", dest="cache", action="store_false", default=True)
    parser.add_argument("-t", "--types", dest="types")
    parser.add_argument("-k", dest="kw", nargs="*")
    parser.add_argument("--slow", action="store_true")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--random", dest="sort", action="store_false", default=True)
    parser.add_argument("--timeout", type=int, default=0)
    for name in VALUED:
        parser.add_argument(name, dest=name.strip("-"))
    for name in FLAGS:
        parser.add_argument(name, action="store_true", dest="ignored_" + name.strip("-").replace("-", "_"))
    found, rest = parser.parse_known_args(argv)
    return found, rest


def test_files(root: str, paths: list[str]) -> list[str]:
    """SymPy's choice: ``test_*.py`` beneath ``sympy/``, where a path is a substring of the file's
    path or matches its name (all of them without paths)."""
    found = []
    for where, dirs, files in os.walk(os.path.join(root, "sympy")):
        dirs.sort()
        found += [os.path.join(where, f) for f in files if fnmatch.fnmatch(f, "test_*.py")]
    found = sorted(os.path.normcase(f) for f in found if not any(b in f for b in BLACKLIST))
    native = [os.path.normpath(p) for p in paths]
    return [f for f in found if not native or any(p in f or fnmatch.fnmatch(os.path.basename(f), p) for p in native)]


def _status(exc: BaseException, slow: bool) -> tuple[str, str]:
    """(SymPy's verbose mark, the record's status) of a test that raised ``exc``."""
    kind = type(exc)
    if kind is KeyboardInterrupt and slow:
        return "s", "SKIPPED"
    if isinstance(exc, (SystemExit, KeyboardInterrupt)) or not isinstance(exc, Exception):
        raise Stop(repr(exc)[:200])
    if kind is _ASSERTION:
        return "F", "FAILED"
    return {"Skipped": ("s", "SKIPPED"), "XFail": ("f", "FAILED"), "XPass": ("X", "FAILED")}.get(
        kind.__name__, ("E", "ERROR"))


def _functions(namespace: dict, path: str, opts: argparse.Namespace) -> list:
    """(name, function) of the file's ``test_*`` functions (defined in it, decorators looked
    through), in source order."""
    funcs = _defined_in(namespace, path)
    if opts.slow:
        funcs = [(line, n, f) for line, n, f in funcs if getattr(f, "_slow", False)]
    if opts.kw:
        funcs = [(line, n, f) for line, n, f in funcs if any(k.lower() in f.__name__.lower() for k in opts.kw)]
    if opts.sort:
        return [(n, f) for _, n, f in sorted(funcs, key=lambda item: item[0])]
    shuffled = [(n, f) for _, n, f in funcs]
    random.shuffle(shuffled)
    return shuffled


def _defined_in(namespace: dict, path: str) -> list:
    """(first line, name, function) of each ``test_*`` function of ``namespace`` whose code
    (through its decorators' ``__wrapped__``) was compiled from ``path``."""
    funcs = []
    for name, value in list(namespace.items()):
        if not (name.startswith("test_") and callable(value) and hasattr(value, "__code__")):
            continue
        inner = value
        while hasattr(inner, "__wrapped__"):
            inner = inner.__wrapped__
        code = getattr(inner, "__code__", None)
        if code is not None and code.co_filename == path:
            funcs.append((code.co_firstlineno, name, value))
    return funcs


def _call(func, seed: int, opts: argparse.Namespace) -> None:
    if getattr(func, "_slow", False) and not opts.slow:
        raise Skipped("Slow")
    with _CATCH():  # SymPy's raise_on_deprecated
        _FILTER("error", ".*", DeprecationWarning, module="sympy.*")
        random.seed(seed)
        if opts.timeout:
            _with_alarm(func, opts.timeout)
        else:
            func()


def _with_alarm(func, seconds: int) -> None:
    import signal

    def expired(signum, frame):
        raise Skipped("Timeout")
    signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        func()
    finally:
        signal.alarm(0)


def _load(path: str, source: str, rel: str, module) -> tuple[dict, bool]:
    """(the file's namespace, whether its body ran clean): ``module`` (compiled before the package
    loaded) executed with the ``exec`` saved then."""
    namespace = {"__file__": path}
    try:
        _EXEC(module if module is not None else _COMPILE(source, path, "exec", 0, True), namespace)
    except (SystemExit, KeyboardInterrupt) as exc:
        raise Stop(repr(exc)[:200]) from None
    except ImportError:
        print(f"{rel} ImportError:\n{traceback.format_exc(limit=-3)}", flush=True)
        return {}, False
    except Exception:  # noqa: BLE001 - SymPy's runner reports it and runs what was defined
        print(f"{rel} Exception:\n{traceback.format_exc(limit=-3)}", flush=True)
        return namespace, False
    return namespace, True


def run_file(path: str, source: str, rel: str, seed: int, opts: argparse.Namespace, record: dict,
             watch=None, module=None) -> bool:
    """Run one file's tests (each checked by ``watch`` just before it is called); False if any
    failed or erred."""
    namespace, ok = _load(path, source, rel, module)
    _clear_cache()
    if not namespace or namespace.get("disabled", False):
        return ok
    funcs = _functions(namespace, path, opts)
    print(f"{rel}[{len(funcs)}] ", end="", flush=True)
    failures = []
    for key, func in funcs:
        if opts.verbose:
            print(f"\n{func.__name__} ", end="", flush=True)
        if watch is not None:
            watch.check(f"{rel}::{key}", func, [(path, "")], key)
        try:
            _call(func, seed, opts)
            mark, status = "ok", "PASSED"
        except BaseException as exc:  # noqa: BLE001 - judged by _status (a stop ends the run)
            mark, status = _status(exc, getattr(func, "_slow", False))
            if status in ("FAILED", "ERROR") and mark in ("F", "E"):
                failures.append((func.__name__, traceback.format_exc(limit=-4)))
        record[func.__name__] = record[f"{rel}::{func.__name__}"] = status
        print(mark if opts.verbose or mark != "ok" else ".", end="", flush=True)
        ok = ok and status not in ("FAILED", "ERROR")
    print(f"\n[{'OK' if ok else 'FAIL'}]", flush=True)
    for name, trace in failures:
        print(f"{'_' * 20} {rel}:{name} {'_' * 20}\n{trace}", flush=True)
    return ok


def _clear_cache() -> None:
    try:
        from sympy.core.cache import clear_cache
    except Exception:  # noqa: BLE001 - an old or broken tree: nothing to clear
        return
    clear_cache()


def _path_for(root: str) -> bool:
    """This file's directory off ``sys.path``, the root last; whether the root is still first."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") not in (here, os.path.abspath(root))]
    sys.path.append(os.path.abspath(root))
    return os.path.abspath(sys.path[0] or ".") == os.path.abspath(root)


def _import_package(root: str, name: str) -> str:
    """Import the repository's package ``name`` from ``ROOT/name`` (not from wherever
    ``sys.path`` would find one first); its file."""
    import importlib.util

    init = os.path.join(os.path.abspath(root), name, "__init__.py")
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[os.path.dirname(init)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module.__file__


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def _digest_of(path: str) -> str:
    try:
        return _digest(_read(path))
    except OSError:
        return "(gone)"


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="surrogateescape") as fh:
        return fh.read()


def changed(mine: dict, saved_builtins: dict) -> list[str]:
    """This script's functions and the builtins it relies on that differ now."""
    names = [f"builtins.{n}" for n, v in saved_builtins.items() if getattr(builtins, n, None) is not v]
    current = sys.modules[__name__].__dict__ if __name__ in sys.modules else globals()
    names += [f"runner.{n}" for n, v in mine.items() if current.get(n) is not v]
    return sorted(names)


def _compiled(path: str, source: str):
    """A test file's code, compiled before the package loads (None if it does not compile: the
    error is reported when the file is run)."""
    try:
        return _COMPILE(source, path, "exec", 0, True)
    except Exception:  # noqa: BLE001 - reported as SymPy's runner reports it, when the file runs
        return None


def _watching(root: str, modules: dict):
    """The watch, started: the test files read (and their decorators' module, ``sympy/testing``),
    each held to the very code this runner compiled from it and executes."""
    watch = load_watch().Watch(root)
    watch.read(list(modules) + [os.path.join(root, "sympy", "testing")])
    for path, module in modules.items():
        watch.index(path, module)
    watch.start()
    return watch


def load_watch():
    """:mod:`tasks.swe.runners.run_watch`, loaded by path from beside this script (the grader copies
    it there as ``.prorl-run-watch.py``), never through ``sys.path``."""
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for name in (".prorl-run-watch.py", "run_watch.py"):
        path = os.path.join(here, name)
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("prorl_run_watch", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    raise SystemExit(f"the grader's run_watch.py is not beside {__file__}")


def _take_nonce(nonce_file: str) -> str:
    """The nonce, read from its file, which is deleted (the package never sees it)."""
    with open(nonce_file) as fh:
        nonce = fh.read().strip()
    os.unlink(nonce_file)
    return nonce


def _read_tests(root: str, paths: list[str]) -> tuple[list[str], dict[str, str], dict]:
    """(the test files the paths choose, their sources, their code): read and compiled before any
    of the repository runs."""
    files = test_files(root, [p for p in paths if not p.startswith("-")])
    sources = {f: _read(f) for f in files}  # before any of the repository runs
    modules = {f: _compiled(f, sources[f]) for f in files}
    return files, sources, modules


def _set_environment(opts: argparse.Namespace) -> int:
    """SymPy's environment variables as ``-C`` and ``-t`` set them; the run's seed."""
    if not opts.cache:
        os.environ["SYMPY_USE_CACHE"] = "no"
    if opts.types:
        os.environ["SYMPY_GROUND_TYPES"] = opts.types
    return opts.seed if opts.seed is not None else random.randrange(100000000)


def _run_facts(root: str, seed: int, files: list[str], paths: list[str], opts: argparse.Namespace) -> dict:
    """The report's facts of the run, known before it starts (``sys.path`` set for it here)."""
    return {"root_first_on_path": _path_for(root), "seed": seed, "python": sys.version.split()[0],
            "files": [os.path.relpath(f, root) for f in files], "sources_read_before_import": True,
            "ignored_options": [p for p in paths if p.startswith("-")] + sorted(
                k for k, v in vars(opts).items() if k.startswith("ignored_") and v)}


def _summary(record: dict[str, str], start: float) -> None:
    """The run's last line in the log, then the run's own output flushed (before the report)."""
    print(f"\n== prorl sympy runner: {sum(v == 'PASSED' for k, v in record.items() if '::' in k)} passed, "
          f"{sum(v != 'PASSED' for k, v in record.items() if '::' in k)} not, in {time.time() - start:.2f} s ==")
    for stream in (sys.stdout, sys.stderr):  # the run's own output first, then the report
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def main() -> int:
    nonce_file, root, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    nonce = _take_nonce(nonce_file)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    mine = {n: v for n, v in globals().items() if callable(v) and not n.startswith("__")}
    saved_builtins = {n: getattr(builtins, n) for n in _BUILTINS}
    opts, paths = options(argv)
    files, sources, modules = _read_tests(root, paths)
    watch = _watching(root, modules)
    seed = _set_environment(opts)
    facts = _run_facts(root, seed, files, paths, opts)
    record: dict[str, str] = {}
    code, start = 0, time.time()
    print(f"prorl sympy runner: python {facts['python']}, seed {seed}, {len(files)} file(s)", flush=True)
    try:  # the package loads and the tests run here in main, at the stack depth they always had
        facts["sympy_file"] = _import_package(root, "sympy")  # after the sources were read

        for path in files:
            if not run_file(path, sources[path], os.path.relpath(path, root), seed, opts, record, watch, modules[path]):
                code = 1
    except Stop as exc:
        facts["error"], code = f"a test ended the run: {exc}", 1
    except BaseException as exc:  # noqa: BLE001 - whatever ended the run, the report says so
        facts["error"], code = repr(exc)[:500], 3
    _summary(record, start)
    facts["rewritten"] = [os.path.relpath(f, root) for f in files if _digest_of(f) != _digest(sources[f])]
    report = {"outcomes": record, "changed": changed(mine, saved_builtins) + watch.changed(), "exit": code,
              **facts, **watch.report()}
    out.write(f"\n{nonce} {json.dumps(report)}\n")
    out.flush()
    return code


if __name__ == "__main__":
    _EXIT(main())
