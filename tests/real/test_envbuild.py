"""Environment recipes built into rootfs images (sandboxes/runtimes/env/build.py), for real: the
node's packages as the base, pip from PyPI at build time, bwrap for the build and for the
sandbox that then uses the image. One small environment (iniconfig from PyPI) per module."""
from __future__ import annotations

import os
import shutil
import threading
import uuid
from pathlib import Path

import pytest

from sandboxes.runtimes.env import build as envbuild
from sandboxes.runtimes.env.build import EnvBuildFailed, EnvRecipe, RepoAt

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None or shutil.which("dpkg-query") is None,
                                reason="needs bubblewrap and a Debian node (dpkg)")
# pywatchman has no wheel (as in Django's test requirements): it builds only with a C compiler
# and Python's headers; the install step's shell=True needs /bin/sh
SMALL = EnvRecipe(name="small", python="3", pip_packages=["iniconfig==2.0.0", "pywatchman==1.4.1"],
                  install=["python3 -c \"import subprocess; subprocess.run('echo built > /usr/local/built-by-recipe', "
                           "shell=True, check=True)\""])


@pytest.fixture(scope="module")
def root() -> Path:
    """The node's environment directory (its base layer is built once and kept); what the tests
    build there is removed afterwards."""
    path = envbuild.env_dir()
    before = set(path.iterdir()) if path.is_dir() else set()
    yield path
    for made in set(path.iterdir()) - before:
        if made.name.startswith("env-"):
            shutil.rmtree(made) if made.is_dir() else made.unlink()


@pytest.fixture
def small() -> EnvRecipe:
    """SMALL, new to the cache each run (a nonce in its variables)."""
    return SMALL.model_copy(update={"env": {"PRORL_TEST_NONCE": uuid.uuid4().hex}})


def test_a_root_other_uids_cannot_enter_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("only a root host builds as another uid")
    tmp_path.chmod(0o700)
    with pytest.raises(EnvBuildFailed, match="cannot enter"):
        envbuild.ensure_base(tmp_path / "envs")


def test_key_is_the_recipe_not_its_label_or_source_path():
    a = SMALL.model_copy(update={"repo": RepoAt(source="/one/place", commit="a" * 40)})
    b = a.model_copy(update={"name": "other", "notes": {"x": 1}, "repo": RepoAt(source="/elsewhere", commit="a" * 40)})
    assert a.key("base1") == b.key("base1")
    assert a.key("base1") != a.key("base2")  # a new base (the node's packages changed) is a new environment
    assert a.key("base1") != a.model_copy(update={"repo": RepoAt(source="/one/place", commit="b" * 40)}).key("base1")
    assert a.key("base1") != a.model_copy(update={"pip_packages": ["iniconfig==2.0.1"]}).key("base1")


def test_script_runs_swebench_steps_in_order_with_the_cutoff():
    recipe = EnvRecipe(requirements=["a>=1"], pip_packages=["b==2", "c"], pre_install=["sed -i s/x/y/ setup.cfg"],
                       install=["python -m pip install -e ."], uploaded_prior_to="2023-04-01")
    lines = envbuild.script(recipe, "/tmp/prorl-bootstrap/pip.whl").splitlines()
    order = [next(i for i, line in enumerate(lines) if needle in line) for needle in
             ("pip.whl/pip install", "setuptools==", "install b==2", "PIP_UPLOADED_PRIOR_TO=2023-04-01",
              "-r /tmp/requirements.txt", "install c", "cd /workspace/repo", "sed -i", "install -e .")]
    assert order == sorted(order), lines


@pytest.mark.slow  # a real build (~17 s); the default suite builds one through the SWE-bench row
def test_concurrent_callers_share_one_build_and_the_image_runs_in_bwrap(root, small, monkeypatch):
    calls = []
    real_build = envbuild._build
    monkeypatch.setattr(envbuild, "_build", lambda *a, **k: calls.append(1) or real_build(*a, **k))
    paths, errors = [], []

    def build():
        try:
            paths.append(envbuild.ensure_env(small, root))
        except Exception as exc:  # noqa: BLE001 - the assertion below shows it
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert errors == [] and len(set(paths)) == 1 and len(calls) == 1, (errors, paths, calls)
    image = paths[0]
    assert (image / "usr/local/built-by-recipe").read_text() == "built\n"
    assert "iniconfig==2.0.0" in (image / "usr/local/prorl-freeze.txt").read_text()
    assert (image / "usr/local").stat().st_uid == 0  # handed back to root after an unprivileged build
    assert not [p for p in root.iterdir() if p.name.startswith(f".{image.name}.")]  # no scratch left
    assert envbuild.ensure_env(small, root) == image and len(calls) == 1  # the next caller: cached

    from sandboxes.base import SandboxSpec
    from sandboxes.runtimes.bwrap import BwrapSandbox

    workspaces = image.parent / f"{image.name}-workspaces"  # removed with the test's environments
    workspaces.mkdir(mode=0o711, exist_ok=True)
    box = BwrapSandbox(SandboxSpec(image=str(image)), "envbuild-test", {"root": str(workspaces)})
    try:
        out = box.exec("python3 -c 'import iniconfig, sys; print(iniconfig.__file__, sys.version_info[:2])'; "
                       "touch /usr/local/x 2>&1; cat /etc/prorl-env.json | head -c 60", timeout=60)
        assert out.exit_code == 0 and "/usr/local/lib/python3" in out.output, out.output
        assert "Read-only file system" in out.output, out.output
        out = box.exec("python3 -c 'import subprocess, pywatchman.bser as b; "
                       "print(b.__file__, subprocess.run(\"echo $0\", shell=True, capture_output=True, text=True).stdout)'; "
                       "printf 'int main(void) { return 7; }' > /tmp/t.c && cc /tmp/t.c -o /tmp/t && /tmp/t; echo \"cc $?\"",
                       timeout=120)
        assert ".so" in out.output and "/bin/sh" in out.output and "cc 7" in out.output, out.output
    finally:
        box.close()


def test_a_failing_build_is_a_typed_error_and_leaves_no_image(root):
    recipe = EnvRecipe(name="broken", install=["echo about to fail; exit 3"], env={"PRORL_TEST_NONCE": uuid.uuid4().hex})
    with pytest.raises(EnvBuildFailed) as caught:
        envbuild.ensure_env(recipe, root)
    assert caught.value.type == "env_build_failed"
    assert "exit 3" in str(caught.value) and "about to fail" in str(caught.value)
    key = recipe.key(envbuild.ensure_base(root)[1])
    assert not (root / f"env-{key}").exists()
    assert not [p for p in root.iterdir() if p.name.startswith(f".env-{key}.")]


def test_a_recipe_for_another_python_fails_before_building(root):
    with pytest.raises(EnvBuildFailed, match="wants Python 2.7"):
        envbuild.ensure_env(EnvRecipe(python="2.7"), root)
