"""Runs a candidate solution against its tests, inside the sandbox (standard library only).

    python3 code_runner.py SPEC.json

SPEC: ``{"solution": path, "tests": {"kind": "python", "code": str, "entry_point": str | null}
| {"kind": "io", "cases": [{"input": str, "output": str}, ...]}, "timeout": seconds per test,
"nonce": str?}``.

Why the solution cannot forge the verdict: the solution's code never runs in this process.
- ``python`` tests: this process (the judge) runs the TEST code; the solution is loaded into a
  child process, and every name the solution defines appears here as a proxy whose calls,
  attribute reads and iteration are requests to the child over a pair of pipes. Replies carry
  plain data only (None, bool, int, float, str, bytes, list, tuple, set, dict), decoded here into
  the built-in types, so every ``==`` and ``assert`` is evaluated here on real built-ins: an
  object that "equals everything", a patched ``json``/``print``/builtins, ``sys.exit`` or
  ``os._exit`` in the child, or a forged report printed to stdout change nothing (the child's
  stdout and stderr are ``/dev/null``; an exit is a failed test). An object the solution returns
  that is not plain data stays in the child behind a handle, which equals nothing but itself.
- ``io`` tests: the solution is a child with its own stdin/stdout; its output is compared here.
- The report: with ``nonce`` in the spec, this process first reads the spec and DELETES it (so the
  solution cannot read the expected outputs or the nonce), makes itself non-dumpable (its memory
  and fds are out of reach of same-uid processes without CAP_SYS_PTRACE, which the sandbox drops),
  and prints ``<nonce> <json>``: the host accepts only that line. A process the solution leaves
  behind can print to the shell's output, but not the nonce; killing this process yields no
  report, which the host scores 0.
Test code is split into single tests: each ``assert`` of a ``check(candidate)`` function (the
HumanEval form) or of the module's top level, and each ``test_*`` function, so the reward can be
the fraction that pass.
"""
from __future__ import annotations

import ast
import builtins
import json
import operator
import os
import select
import signal
import subprocess
import sys
import time
import traceback

MAX_DEPTH = 64
MAX_REPLY = 64 << 20


class _Timeout(Exception):
    pass


class SolutionError(Exception):
    """The solution's process raised, died, or answered something that is not plain data."""


# -- wire format: tagged JSON; the judge decodes into built-ins only ----------------------------

def encode(value, ref, depth: int = 0):
    """``value`` as JSON data; ``ref(value)`` encodes what is not plain data (or raises)."""
    if value is None or type(value) in (bool, int, str):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__index__(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, float):
        return {"t": "float", "v": repr(float.__float__(value))}
    if isinstance(value, complex):
        return {"t": "complex", "v": [repr(value.real), repr(value.imag)]}
    if isinstance(value, (bytes, bytearray)):
        return {"t": "bytearray" if isinstance(value, bytearray) else "bytes", "v": bytes(value).hex()}
    if depth < MAX_DEPTH:
        for kind in (list, tuple, set, frozenset):
            if isinstance(value, kind):
                return {"t": kind.__name__, "v": [encode(item, ref, depth + 1) for item in value]}
        if isinstance(value, dict):
            return {"t": "dict", "v": [[encode(k, ref, depth + 1), encode(v, ref, depth + 1)]
                                       for k, v in value.items()]}
    if hasattr(type(value), "__index__") and not callable(value):  # numpy integers
        return operator.index(value)
    return ref(value)


_KINDS = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}


def decode(data, ref):
    """Data from ``encode`` as built-ins; ``ref(data)`` turns a reference into an object."""
    if data is None or type(data) in (bool, int, str, float):
        return data
    if type(data) is not dict or type(data.get("t")) is not str:
        raise SolutionError(f"malformed value {str(data)[:80]!r}")
    kind, value = data["t"], data.get("v")
    if kind == "ref":
        return ref(data)
    if kind == "float" and type(value) is str:
        return float(value)
    if kind == "complex" and type(value) is list and len(value) == 2:
        return complex(float(str(value[0])), float(str(value[1])))
    if kind in ("bytes", "bytearray") and type(value) is str:
        return (bytes if kind == "bytes" else bytearray).fromhex(value)
    if kind in _KINDS and type(value) is list:
        return _KINDS[kind](decode(item, ref) for item in value)
    if kind == "dict" and type(value) is list:
        return {decode(k, ref): decode(v, ref) for k, v in value}
    raise SolutionError(f"malformed value of kind {kind[:20]!r}")


# -- the child: holds the solution, answers requests -------------------------------------------

def child_main(rfd: int, wfd: int) -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the solution's prints are nobody's business
        os.dup2(devnull, fd)
    namespace: dict = {"__name__": "__candidate__"}
    objects: list = []

    def keep(value):
        objects.append(value)
        return {"t": "ref", "v": {"o": len(objects) - 1}}

    def resolve(data):
        where = data["v"]
        return namespace[where["g"]] if "g" in where else objects[where["o"]]

    with os.fdopen(rfd, "rb") as reader, os.fdopen(wfd, "wb") as writer:
        for line in reader:
            try:
                reply = {"value": encode(_serve(json.loads(line), namespace, resolve), keep)}
            except BaseException as exc:  # noqa: BLE001 - the solution's failure is data
                reply = {"error": [type(exc).__name__, str(exc)[-300:]]}
            writer.write(json.dumps(reply).encode() + b"\n")
            writer.flush()


def _serve(msg: dict, namespace: dict, resolve):
    op = msg["op"]
    if op == "load":
        exec(compile(msg["code"], "<solution>", "exec"), namespace)  # noqa: S102 - the sandboxed child
        return {name: value for name, value in namespace.items()
                if not name.startswith("__") and type(value).__name__ != "module"}
    target = resolve(msg["target"])
    args = [decode(a, resolve) for a in msg.get("args", [])]
    kwargs = {k: decode(v, resolve) for k, v in msg.get("kwargs", {}).items()}
    actions = {"call": lambda: target(*args, **kwargs), "attr": lambda: getattr(target, msg["name"]),
               "item": lambda: target[args[0]], "len": lambda: len(target), "bool": lambda: bool(target),
               "list": lambda: list(target), "contains": lambda: args[0] in target,
               "repr": lambda: repr(target)[:200]}
    return actions[op]()


# -- the judge's side ---------------------------------------------------------------------------

class Remote:
    """The solution's child process; respawned (and the solution reloaded) after it dies."""

    def __init__(self, solution: str):
        self.solution = solution
        self.proc: subprocess.Popen | None = None
        self.deadline = 0.0
        self.generation = 0
        self.names: dict = {}

    def start(self) -> None:
        r_req, w_req = os.pipe()
        r_rep, w_rep = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), "--child", str(r_req), str(w_rep)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(r_req, w_rep))
        os.close(r_req)
        os.close(w_rep)
        self._w, self._r, self._buf = w_req, r_rep, b""
        self.generation += 1
        loaded = self.ask({"op": "load", "code": self.solution}, raw=True, respawn=False)
        if type(loaded) is not dict or loaded.get("t") != "dict":
            raise SolutionError("the solution's process did not load it")
        self.names = {}
        for key, value in loaded["v"]:
            if type(key) is str:
                self.names[key] = Handle(self, {"g": key}, 0) if isinstance(value, dict) and \
                    value.get("t") == "ref" else decode(value, self._ref)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            os.close(self._w)
            os.close(self._r)
            self.proc = None

    def _ref(self, data) -> Handle:
        where = data.get("v")
        if type(where) is not dict or type(where.get("o")) is not int:
            raise SolutionError("malformed reference")
        return Handle(self, {"o": where["o"]}, self.generation)

    def ask(self, msg: dict, raw: bool = False, respawn: bool = True):
        if respawn and not self.alive():
            self.kill()
            self.start()
        try:
            os.write(self._w, json.dumps(msg).encode() + b"\n")
            reply = json.loads(self._read_line())
        except BaseException:
            self.kill()  # its state is unknown now (a timeout, a death, garbage)
            raise
        if type(reply) is not dict:
            raise SolutionError("malformed reply")
        if "error" in reply:
            raise _rebuild(reply["error"])
        return reply.get("value") if raw else decode(reply.get("value"), self._ref)

    def _read_line(self) -> bytes:
        while b"\n" not in self._buf:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise _Timeout()
            ready, _, _ = select.select([self._r], [], [], left)
            chunk = os.read(self._r, 1 << 16) if ready else None
            if chunk == b"":
                status = self.proc.wait()
                raise SolutionError(f"the solution's process exited (status {status})")
            if chunk:
                self._buf += chunk
                if len(self._buf) > MAX_REPLY:
                    raise SolutionError("reply too large")
        line, _, self._buf = self._buf.partition(b"\n")
        return line


def _rebuild(error) -> BaseException:
    """The child's exception as one of the built-in exception types (a test may expect it)."""
    name, message = (error + ["", ""])[:2] if type(error) is list else ("Error", "")
    found = getattr(builtins, str(name), None)
    if isinstance(found, type) and issubclass(found, Exception) and found is not AssertionError:
        return found(str(message))
    return SolutionError(f"{name}: {message}")


class Handle:
    """An object that lives in the solution's process. Equal only to itself."""

    __slots__ = ("_remote", "_where", "_generation")

    def __init__(self, remote: Remote, where: dict, generation: int):
        self._remote, self._where, self._generation = remote, where, generation

    def _ask(self, op: str, *args, **fields):
        if self._generation and self._generation != self._remote.generation:
            raise SolutionError("the solution's process was restarted; this object is gone")
        msg = {"op": op, "target": {"t": "ref", "v": self._where},
               "args": [encode(a, _pass_ref) for a in args], **fields}
        return self._remote.ask(msg)

    def __getattr__(self, name: str):
        return self._ask("attr", name=name)

    def __call__(self, *args, **kwargs):
        return self._ask("call", *args, kwargs={k: encode(v, _pass_ref) for k, v in kwargs.items()})

    def __getitem__(self, key):
        return self._ask("item", key)

    def __len__(self) -> int:
        return int(self._ask("len"))

    def __iter__(self):
        return iter(self._ask("list"))

    def __contains__(self, item) -> bool:
        return bool(self._ask("contains", item))

    def __bool__(self) -> bool:
        return bool(self._ask("bool"))

    def __eq__(self, other) -> bool:
        return isinstance(other, Handle) and other._where == self._where

    def __hash__(self) -> int:
        return hash(json.dumps(self._where))

    def __repr__(self) -> str:
        return f"<solution object {self._ask('repr')}>"


def _pass_ref(value):
    if isinstance(value, Handle):
        return {"t": "ref", "v": value._where}
    raise TypeError(f"cannot pass a {type(value).__name__} to the solution")


def _alarm(signum, frame):
    raise _Timeout()


def _judge(code: str, env: dict, remote: Remote, timeout: float) -> tuple[bool, str]:
    """Run trusted test ``code`` here; the solution's names in ``env`` are proxies."""
    remote.deadline = time.monotonic() + timeout
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        exec(compile(code, "<test>", "exec"), env)  # noqa: S102 - the test code is trusted
        return True, ""
    except _Timeout:
        remote.kill()
        return False, f"timed out after {timeout}s"
    except BaseException as exc:  # noqa: BLE001 - a failing test is data
        return False, "".join(traceback.format_exception_only(type(exc), exc)).strip()[-500:]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _split(code: str, entry_point: str | None) -> tuple[list[str], list[tuple[str, str]]]:
    """(setup statements, [(name, test statement)]) from Python test code."""
    tree = ast.parse(code)
    setup, tests = [], []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            args = [a.arg for a in node.args.args]
            bind = f"{args[0]} = {entry_point}\n" if args and entry_point else ""
            body_setup = [bind] if bind else []
            found = len(tests)
            for stmt in node.body:
                if isinstance(stmt, ast.Assert):
                    tests.append((f"check:{stmt.lineno}", "".join(body_setup) + ast.unparse(stmt)))
                else:
                    body_setup.append(ast.unparse(stmt) + "\n")
            if len(tests) == found:  # asserts only inside loops: the whole check is one test
                setup.append(ast.unparse(node))
                tests.append(("check", f"check({entry_point})"))
        elif isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            setup.append(ast.unparse(node))
            tests.append((node.name, f"{node.name}()"))
        elif isinstance(node, ast.Assert):
            tests.append((f"line:{node.lineno}", ast.unparse(node)))
        else:
            setup.append(ast.unparse(node))
    return setup, tests


def _load(remote: Remote, timeout: float) -> str:
    remote.deadline = time.monotonic() + timeout
    try:
        remote.start()
        return ""
    except BaseException as exc:  # noqa: BLE001
        remote.kill()
        return "timed out" if isinstance(exc, _Timeout) else str(exc)[-500:] or type(exc).__name__


def run_python(solution: str, spec: dict, timeout: float) -> list[dict]:
    setup, tests = _split(spec["code"], spec.get("entry_point"))
    if not tests:
        return [{"name": "module", "passed": False, "error": "no tests found"}]
    remote = Remote(solution)
    error = _load(remote, timeout)
    if error:
        return [{"name": name, "passed": False, "error": f"solution failed to load: {error}"} for name, _ in tests]
    env = {"__name__": "__test__", **remote.names}
    ok, error = _judge("\n".join(setup), env, remote, timeout)
    results = []
    for name, code in tests:
        if ok and not remote.alive() and (why := _load(remote, timeout)):
            results.append({"name": name, "passed": False, "error": f"solution failed to load: {why}"})
            continue
        passed, why = _judge(code, {**env, **remote.names}, remote, timeout) if ok else \
            (False, f"test setup failed: {error}")
        results.append({"name": name, "passed": passed, "error": why})
    remote.kill()
    return results


def run_io(solution_path: str, cases: list[dict], timeout: float) -> list[dict]:
    results = []
    for i, case in enumerate(cases):
        try:
            done = subprocess.run([sys.executable, solution_path], input=case.get("input", ""), text=True,
                                  capture_output=True, timeout=timeout)
            got, want = done.stdout.strip().split(), str(case.get("output", "")).strip().split()
            passed = done.returncode == 0 and got == want
            error = "" if passed else (done.stderr.strip()[-300:] or f"expected {want[:20]}, got {got[:20]}")
        except subprocess.TimeoutExpired:
            passed, error = False, f"timed out after {timeout}s"
        results.append({"name": f"case:{i}", "passed": passed, "error": error})
    return results


def _guard_self() -> None:
    """Non-dumpable: same-uid processes cannot read this one's memory, fds or environment."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except (OSError, AttributeError):
        pass


def main() -> None:
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    nonce = spec.get("nonce")
    if nonce:  # the tests and the nonce leave the sandbox's filesystem before the solution runs
        os.unlink(sys.argv[1])
        _guard_self()
    with open(spec["solution"]) as fh:
        solution = fh.read()
    tests, timeout = spec["tests"], float(spec.get("timeout", 6))
    if tests["kind"] == "io":
        results = run_io(spec["solution"], tests["cases"], timeout)
    else:
        results = run_python(solution, tests, timeout)
    passed = sum(r["passed"] for r in results)
    line = json.dumps({"passed": passed, "total": len(results), "results": results})
    sys.stdout.write(f"\n{nonce} {line}\n" if nonce else line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child_main(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
