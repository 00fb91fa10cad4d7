"""The sandbox interface stands above its implementations: the interface modules (registry,
policy, client, provider ...) and the beat sweep import no runtime and no host, what is special
about a runtime is its own hook, and the interface modules form no import circle."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from sandboxes.base import SandboxRuntime, SandboxSpec
from sandboxes.check import check_runtime_class
from sandboxes.provider import SandboxProvider, sandbox_provider
from sandboxes.registry import load_runtime, resolve_auto

ROOT = Path(__file__).resolve().parents[2]
INTERFACE = ["sandboxes.base", "sandboxes.protocol", "sandboxes.registry", "sandboxes.policy",
             "sandboxes.check", "sandboxes.client", "sandboxes.images", "sandboxes.dirs",
             "sandboxes.provider"]


def test_the_interface_and_the_sweep_import_no_runtime_or_host():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in [*INTERFACE, "tasks.sweep.sandboxes"])
            + "print(sorted(m for m in sys.modules if m.startswith(('sandboxes.runtimes', 'sandboxes.host'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _imports(module: str) -> set[str]:
    """Every project module ``module`` imports, at any depth (function bodies too), except under
    ``if TYPE_CHECKING``."""
    path = ROOT / (module.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", "") == "TYPE_CHECKING" for node in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update({node.module, *(f"{node.module}.{alias.name}" for alias in node.names)})
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("sandboxes.")} - {module}


@pytest.mark.unit
def test_no_import_circle_through_the_interface():
    graph = {module: _imports(module) & set(INTERFACE) for module in INTERFACE}
    for start in INTERFACE:  # a path from a module back to itself
        seen, frontier = set(), list(graph[start])
        while frontier:
            here = frontier.pop()
            assert here != start, f"{start} imports itself through {sorted(seen)}"
            if here not in seen:
                seen.add(here)
                frontier.extend(graph[here])
    assert not any(name.startswith(("sandboxes.runtimes", "sandboxes.host"))
                   for module in INTERFACE for name in _imports(module))


def test_every_built_in_runtime_has_the_hooks_and_says_what_auto_prefers():
    ranks = {name: load_runtime(name).auto_rank for name in ("bwrap", "local", "singularity")}
    assert ranks["bwrap"] > ranks["local"] > 0 == ranks["singularity"]
    for name in ranks:
        check_runtime_class(load_runtime(name))
        assert load_runtime(name).available({}) in (True, False)
    assert load_runtime("local").strays() == [] and load_runtime("bwrap").strays() == []


@pytest.mark.unit
def test_the_available_hook_takes_the_hosts_config():
    bwrap = load_runtime("bwrap")
    assert bwrap.available({"bwrap": "/nonexistent/bwrap"}) is False
    assert resolve_auto(["bwrap"], {"bwrap": {"bwrap": "/nonexistent/bwrap"}}) is None


class _Unisolated(SandboxRuntime):
    """Says it isolates nothing, and asks to be auto's first choice."""

    isolation = "none"
    auto_rank = 9

    def __init__(self, spec: SandboxSpec, job_id: str, config=None): ...


@pytest.mark.unit
def test_auto_never_picks_an_unisolated_runtime_the_operator_did_not_allow(monkeypatch):
    from config.settings import get_settings

    monkeypatch.setattr(get_settings(), "allow_local_runtime", False)
    name = f"{__name__}:_Unisolated"
    monkeypatch.setattr("sandboxes.registry.load_runtime", lambda n: _Unisolated if n == name else load_runtime(n))
    assert resolve_auto([name, "local"]) is None
    monkeypatch.setattr(get_settings(), "allow_local_runtime", True)
    assert resolve_auto([name, "local"]) == name


def test_the_hosts_provider_takes_the_seat(redis_client):
    provider = sandbox_provider(redis_client)
    assert isinstance(provider, SandboxProvider) and type(provider).__name__ == "HostProvider"
    with pytest.raises(Exception, match="unknown sandbox provider 'cloud'"):
        sandbox_provider(redis_client, "cloud")


@pytest.mark.unit
def test_the_host_asks_the_declared_open_file_hook():
    """The host's read route streams what ``open_file`` opens; a runtime without it (the base's
    None) is answered with ``read_file``'s bytes: no probing with hasattr."""
    import inspect

    from sandboxes.host import app

    assert "hasattr" not in inspect.getsource(app)
    assert SandboxRuntime.open_file(object(), "x") is None
    assert load_runtime("local").open_file is not SandboxRuntime.open_file
