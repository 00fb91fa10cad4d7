"""check_sandbox and check_runtime_class: the runtimes conform, and a sandbox that breaks one
promise of the protocol is caught by the check, naming the promise."""
from __future__ import annotations

import pytest

from prorl_celery.errors import UnknownPlugin
from sandboxes.base import ExecResult, SandboxRuntime, SandboxSpec
from sandboxes.check import METHODS as check_methods
from sandboxes.check import NonConformant, check_runtime_class, check_sandbox
from sandboxes.protocol import METHODS as PROTOCOL
from sandboxes.runtimes.local import LocalSandbox
from sandboxes.registry import RUNTIMES, load_runtime
from tests.sandboxes.conftest import needs_bwrap


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(RUNTIMES.entries))
def test_registered_runtime_classes_conform(name):
    check_runtime_class(load_runtime(name))


@pytest.mark.parametrize("kind", ["local", pytest.param("bwrap", marks=needs_bwrap())])
def test_live_runtimes_pass_the_check(kind, sandbox_root, tmp_path):
    box = load_runtime(kind)(SandboxSpec(), "check-job", {"root": str(sandbox_root)})
    try:
        check_sandbox(box)
    finally:
        box.close()


class ForgetsCwd(LocalSandbox):
    """Runs every command in a fresh shell at the workspace: state does not carry over."""

    def exec(self, command: str, timeout: float | None = None) -> ExecResult:
        return super().exec(f"cd ~ && ({command})", timeout)


class LeavesZombieCommands(LocalSandbox):
    """Reports a timeout but never kills the command's process tree."""

    def exec(self, command: str, timeout: float | None = None) -> ExecResult:
        if timeout is not None and timeout < 1:
            super().exec(f"nohup bash -c '{command}' >/dev/null 2>&1 &")
            return ExecResult(output="", exit_code=None, timed_out=True)
        return super().exec(command, timeout)


def test_check_finds_a_sandbox_that_forgets_its_cwd(sandbox_root, tmp_path):
    box = ForgetsCwd(SandboxSpec(), "check-cwd", {"root": str(sandbox_root)})
    try:
        with pytest.raises(NonConformant, match="cwd or environment does not carry over"):
            check_sandbox(box)
    finally:
        box.close()


@pytest.mark.slow  # ~10 s: it waits out the check's command timeout
def test_check_finds_a_timeout_that_leaves_processes(sandbox_root, tmp_path):
    box = LeavesZombieCommands(SandboxSpec(), "check-zombie", {"root": str(sandbox_root)})
    try:
        with pytest.raises(NonConformant, match="background processes survive"):
            check_sandbox(box, close=False)
    finally:
        box.exec("pkill -f 'sleep 31' || true")
        box.close()


class NoInterrupt:
    def __init__(self, spec, job_id, config=None): ...
    def exec(self, command, timeout=None): ...
    def read_file(self, path): ...
    def write_file(self, path, data): ...
    def stat(self, path): ...
    def close(self): ...
    def info(self): ...


class WrongConstructor(NoInterrupt):
    def __init__(self, spec): ...
    def interrupt(self): ...


@pytest.mark.unit
def test_runtime_classes_missing_a_method_or_the_constructor_are_refused():
    with pytest.raises(UnknownPlugin, match="no method interrupt"):
        check_runtime_class(NoInterrupt)
    with pytest.raises(UnknownPlugin, match=r"cannot be created as cls\(spec, job_id, config\)"):
        check_runtime_class(WrongConstructor)


class NoHooks(WrongConstructor):
    def __init__(self, spec, job_id, config=None): ...


class WithHooks(SandboxRuntime, NoHooks):
    isolation = "none"


@pytest.mark.unit
def test_the_optional_hooks_are_part_of_the_contract_and_inherited_from_the_base():
    with pytest.raises(UnknownPlugin, match="no method available.*no method kill.*no isolation"):
        check_runtime_class(NoHooks)
    check_runtime_class(WithHooks)
    assert WithHooks.warm_spec(SandboxSpec()) is None and WithHooks.available()
    with pytest.raises(NotImplementedError):
        WithHooks(None, "j").claim("j", SandboxSpec())


@pytest.mark.unit
def test_the_class_check_asks_for_each_protocol_method_with_its_request_fields():
    assert check_methods == {name: tuple(method.request.model_fields)
                             for name, method in PROTOCOL.items() if name not in ("renew", "relay", "forward")}
    assert "renew" not in check_methods  # the host's lease, not a runtime's method
    assert "relay" not in check_methods  # the host's pipe to a gateway on another node, not a runtime's
    assert "forward" not in check_methods  # the host's splice between two of its sandboxes


class NoStat(WithHooks):
    stat = None  # type: ignore[assignment]


class ReadsByAnotherName(WithHooks):
    def read_file(self, filename): ...  # the host passes path=...


class ExecWithoutTimeout(WithHooks):
    def exec(self, command): ...  # the host passes timeout=... too


@pytest.mark.unit
def test_runtime_classes_lacking_a_protocol_method_or_taking_the_wrong_argument_are_refused():
    with pytest.raises(UnknownPlugin, match="no method stat"):
        check_runtime_class(NoStat)
    with pytest.raises(UnknownPlugin, match=r"read_file\(path\) cannot be called"):
        check_runtime_class(ReadsByAnotherName)
    with pytest.raises(UnknownPlugin, match=r"exec\(command, timeout\) cannot be called"):
        check_runtime_class(ExecWithoutTimeout)
