"""The solution's side of :mod:`code_runner` and the wire between the two (standard library only).

The solution runs in a child process (``python3 -I code_proxy.py --child RFD WFD``); the judge
talks to it through :class:`Remote`, and every name the solution defines is a :class:`Handle`
there. Replies are tagged JSON that decodes into built-in types only (see ``code_runner``'s
docstring for why the verdict cannot be forged).
"""
from __future__ import annotations

import builtins
import json
import operator
import os
import select
import subprocess
import sys
import time

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


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child_main(int(sys.argv[2]), int(sys.argv[3]))
