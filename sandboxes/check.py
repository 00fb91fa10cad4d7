"""``check_sandbox``: the contract every sandbox runtime passes (Gymnasium's ``check_env`` for
sandboxes), in process or over HTTP alike.

Two halves. :func:`check_runtime_class` is static and runs whenever the registry loads a runtime
class (the protocol's methods exist and take the arguments the host passes). :func:`check_sandbox`
drives a live sandbox through what an agent and the stages rely on and raises
:class:`NonConformant` listing each behaviour that differs; the contract test runs it for every
runtime.
"""
from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable

from prorl_celery.errors import SandboxGone, UnknownPlugin
from sandboxes.base import Sandbox
from sandboxes.protocol import METHODS as PROTOCOL

# the protocol's methods a runtime implements and the arguments the host passes them by name
# (besides ``self``): the fields of each method's request model
METHODS: dict[str, tuple[str, ...]] = {
    name: method.arguments for name, method in PROTOCOL.items() if not method.host_only}
# the optional hooks (:class:`~sandboxes.base.SandboxRuntime` has defaults for each); those in
# _CLASS_HOOKS are called on the class
HOOKS: dict[str, tuple[str, ...]] = {
    "available": ("config",), "warm_spec": ("spec",), "claim": ("job_id", "spec"), "kill": (),
    "open_file": ("path",), "netns_fd": (), "usage": (),
    "strays": ("config",), "stop_stray": ("name", "config")}
_CLASS_HOOKS = ("available", "warm_spec", "strays", "stop_stray")
_conformant: set[type] = set()  # checked once per class: the registry loads one per create


class NonConformant(AssertionError):
    """A sandbox that does not behave as the protocol says; the message lists each finding."""


def _call_problem(cls: type, method: str, args: tuple[str, ...], on_class: bool = False,
                  by_name: bool = True) -> str | None:
    """Why ``method`` of ``cls`` cannot be called with ``args`` (None: it can): by name, as the
    host's generic route calls a protocol method, or in order, as the host calls a hook."""
    func = getattr(cls, method, None)
    if not callable(func):
        return f"no method {method}"
    bound = () if on_class else (None,)
    try:
        if by_name:
            inspect.signature(func).bind(*bound, **dict.fromkeys(args))
        else:
            inspect.signature(func).bind(*bound, *args)
    except TypeError as exc:
        return f"{method}({', '.join(args)}) cannot be called: {exc}"
    return None


def check_runtime_class(cls: type) -> None:
    """Raise :class:`UnknownPlugin` when ``cls`` cannot serve as a runtime: the protocol's
    methods, the hooks (a runtime inherits them from :class:`~sandboxes.base.SandboxRuntime`),
    ``isolation`` and the constructor."""
    if cls in _conformant:
        return
    problems = [problem for method, args in METHODS.items()
                if (problem := _call_problem(cls, method, args))]
    problems += [problem for method, args in HOOKS.items()
                 if (problem := _call_problem(cls, method, args, method in _CLASS_HOOKS, False))]
    if not isinstance(getattr(cls, "isolation", None), str):
        problems.append("no isolation (a str such as 'namespaces')")
    try:
        inspect.signature(cls).bind("spec", "job_id", None)
    except TypeError as exc:
        problems.append(f"it cannot be created as cls(spec, job_id, config): {exc}")
    if problems:
        raise UnknownPlugin(f"sandbox runtime {cls.__module__}:{cls.__qualname__} does not conform: "
                            + "; ".join(problems))
    _conformant.add(cls)


def _raises(kind: type[BaseException], call: Callable[[], object]) -> bool:
    try:
        call()
    except kind:
        return True
    except Exception:  # noqa: BLE001 - another exception is a finding too
        return False
    return False


def _shell(box: Sandbox) -> list[str]:
    """A persistent shell: output, exit codes, cwd and environment carry over."""
    found = []
    if box.exec("(exit 3)").exit_code != 3:
        found.append("exit codes are not reported")
    box.exec("mkdir -p d && cd d && export CHECK_FOO=bar")
    if box.exec('basename "$PWD"; echo "$CHECK_FOO"').output != "d\nbar\n":
        found.append("cwd or environment does not carry over between commands")
    box.exec("cd ~")
    return found


def _timeouts(box: Sandbox) -> list[str]:
    """A timeout kills the command's whole process tree; an interrupt from another thread stops
    a command; the shell stays usable after both."""
    found = []
    started = time.monotonic()
    result = box.exec("(sleep 31.25 &); sleep 31.5 & sleep 31.75", timeout=0.5)
    # the sleeps run 31 s: 15 s tells a timeout from none on a loaded node too
    if not (result.timed_out and result.exit_code is None) or time.monotonic() - started > 15:
        found.append(f"a timed-out command is not reported as such within 15 s ({result!r})")
    if not _gone_within(box, "sleep 31\\.", 10.0):  # killed ones may take a moment to be reaped
        found.append("a timed-out command's background processes survive")
    results = []
    runner = threading.Thread(target=lambda: results.append(box.exec("sleep 30", timeout=60)))
    runner.start()
    time.sleep(0.3)
    box.interrupt()
    runner.join(5)
    if not (results and results[0].interrupted):
        found.append("interrupt() does not stop the running command")
    if box.exec("echo alive").output != "alive\n":
        found.append("the shell is not usable after a timeout and an interrupt")
    long = box.exec("seq 1 200000")
    if not (long.truncated and long.output.startswith("1\n2\n") and long.output.endswith("200000\n")):
        found.append("long output does not keep its head and tail")
    return found


def _gone_within(box: Sandbox, pattern: str, seconds: float) -> bool:
    """Whether no process matches ``pattern`` within ``seconds`` (bounded polls)."""
    deadline = time.monotonic() + seconds
    while box.exec(f"pgrep -f '{pattern}' || echo none").output != "none\n":
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True


def _files(box: Sandbox) -> list[str]:
    """Files are binary-safe, relative to the workspace and never outside it; ``stat`` tells a
    file, a directory and a symlink apart without following it."""
    found = []
    data = bytes(range(256)) * 40 + b"\x00"
    box.write_file("sub/blob.bin", data)
    if box.read_file("sub/blob.bin") != data:
        found.append("read_file does not return what write_file wrote")
    box.exec("cd ~ && ln -sf /etc/passwd check-sneaky")
    if not _raises(FileNotFoundError, lambda: box.read_file("check-nope.txt")):
        found.append("a missing file is not FileNotFoundError")
    for path in ("check-sneaky", "../outside.txt"):
        if not _raises(PermissionError, lambda path=path: box.read_file(path)):
            found.append(f"read_file({path!r}) leaves the workspace")
    if not _raises(PermissionError, lambda: box.write_file("check-sneaky", b"x")):
        found.append("write_file follows a symlink out of the workspace")
    kinds = [(box.stat(path).kind, box.stat(path).size) for path in ("sub/blob.bin", "sub")]
    if kinds[0] != ("file", len(data)) or kinds[1][0] != "dir" or box.stat("check-sneaky").kind != "link":
        found.append(f"stat does not tell a file, a directory and a symlink apart ({kinds})")
    if not _raises(PermissionError, lambda: box.stat("../outside.txt")):
        found.append("stat leaves the workspace")
    return found


def _export(box: Sandbox) -> list[str]:
    """``export_tree`` of workspace paths (relative ones too): the files as written, a symlink
    stored as a symlink (never followed), the cap enforced."""
    import io
    import tarfile

    found = []
    tar = tarfile.open(fileobj=io.BytesIO(box.export_tree(["sub", "check-sneaky"], 1 << 20)))
    members = {info.name.rsplit("/", 2)[-2] + "/" + info.name.rsplit("/", 1)[-1]: info for info in tar}
    blob = next((info for name, info in members.items() if name.endswith("sub/blob.bin")), None)
    if blob is None or tar.extractfile(blob).read() != box.read_file("sub/blob.bin"):
        found.append("export_tree does not carry a workspace file")
    links = [info for info in tar if info.name.endswith("check-sneaky")]
    if len(links) != 1 or not links[0].issym() or links[0].linkname != "/etc/passwd":
        found.append("export_tree does not store a symlink as a symlink")
    if any(info.uid or info.gid for info in tar):
        found.append("export_tree keeps owners")
    if not _raises(OSError, lambda: box.export_tree(["sub"], 1024)):
        found.append("export_tree goes past max_bytes")
    return found


def _close(box: Sandbox) -> list[str]:
    """Closing is final and idempotent."""
    found = []
    if not box.info().get("pid"):
        found.append("info() names no pid")
    box.close()
    box.close()
    if not _raises(SandboxGone, lambda: box.exec("echo hi")):
        found.append("a closed sandbox does not raise SandboxGone")
    return found


def check_sandbox(box: Sandbox, close: bool = True) -> None:
    """Drive ``box`` through the protocol's behaviour; raise :class:`NonConformant` with every finding.
    With ``close`` the sandbox is closed last, checking that closing is final."""
    if not isinstance(box, Sandbox):
        raise NonConformant(f"{type(box).__name__} does not implement the Sandbox protocol")
    found = _shell(box) + _timeouts(box) + _files(box) + _export(box)
    if close:
        found += _close(box)
    if found:
        raise NonConformant("; ".join(found))
