"""Frozen layers in real bwrap sandboxes (``writable_root``): a prepared sandbox's root frozen
once, then sandboxes started on it copy-on-write: each sees the prepared files (deletions
included), none sees another's writes, and nothing a sandbox does changes the layer."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from prorl_celery.errors import SandboxError
from sandboxes.base import SandboxSpec
from sandboxes.runtimes import layers
from sandboxes.runtimes.bwrap import BwrapSandbox
from sandboxes.runtimes.limits import idmap
from tests.rootfs import build_rootfs
from tests.sandboxes.conftest import needs_bwrap
from tests.sandboxes.test_writable_root import TOOLS, digest

pytestmark = [pytest.mark.harbor, needs_bwrap(),
              pytest.mark.skipif(bool(idmap.why_not()), reason=idmap.why_not() or "-")]
NAME = "test-layer-0123456789abcdef"


@pytest.fixture(scope="module")
def image() -> Path:
    top = Path(tempfile.mkdtemp(prefix="prorl-test-layer-images-"))
    top.chmod(0o755)
    base = top / "base"
    base.mkdir()
    build_rootfs(base, TOOLS)
    (base / "etc" / "doomed").write_text("in the image\n")
    (base / "app").mkdir()
    (base / "etc" / "prorl-image.json").write_text(json.dumps({"env": {}, "workdir": "/app"}))
    base.chmod(0o755)
    yield base
    os.system(f"rm -rf {top}")


@pytest.fixture
def layer_dir(monkeypatch) -> Path:
    root = Path(tempfile.mkdtemp(prefix="prorl-test-layers-"))
    monkeypatch.setenv("PRORL_SANDBOX_LAYER_DIR", str(root / "layers"))
    from config.settings import get_settings

    get_settings.cache_clear()
    yield root / "layers"
    os.system(f"rm -rf {root}")
    get_settings.cache_clear()


def box(image: Path, root: Path, names: list[str] | None = None) -> BwrapSandbox:
    spec = SandboxSpec(image=str(image), writable_root=True, workdir="/app", layers=names or [])
    return BwrapSandbox(spec, "layers", {"root": str(root)})


def test_forks_start_from_the_frozen_root_and_never_see_each_other(image, sandbox_root, layer_dir):
    prepared = box(image, sandbox_root)
    out = prepared.exec("echo prepared > /app/data && mkdir -p /app/repo/sub && echo deep > /app/repo/sub/f "
                        "&& rm /etc/doomed && (sleep 1000 &) && echo ok")
    assert out.exit_code == 0, out.output
    entry = prepared.freeze(NAME, group_id="g1", job_id="j1")
    assert entry.name == NAME and entry.group_id == "g1" and entry.files >= 4
    tree = layer_dir / NAME / "tree"
    assert os.stat(tree / "app" / "data").st_uid == 0 and os.stat(tree).st_mode & 0o022 == 0
    frozen = digest(tree)

    forks = [box(image, sandbox_root, [NAME]) for _ in range(3)]
    try:
        first, second, third = forks
        for fork, word in ((first, "first"), (second, "second")):
            out = fork.exec(f"echo {word} > /app/data && echo {word} >> /app/repo/sub/f && rm -rf /app/repo/sub "
                            f"&& mkdir -p /app/repo/sub && echo {word} > /app/repo/sub/f && cat /app/data")
            assert out.exit_code == 0 and out.output == f"{word}\n", out.output
        assert first.exec("cat /app/data /app/repo/sub/f").output == "first\nfirst\n"
        assert second.exec("cat /app/data /app/repo/sub/f").output == "second\nsecond\n"
        seen = third.exec("cat /app/data /app/repo/sub/f; test -e /etc/doomed && echo back; id -u; "
                          "echo x > /etc/newfile && echo writable")
        assert seen.output == "prepared\ndeep\n0\nwritable\n", seen.output  # the deletion carried over too
        assert {entry.name: entry.in_use for entry in layers.list_layers()} == {NAME: True}
        assert layers.remove([NAME]) == []  # held by live sandboxes: kept
    finally:
        for fork in forks:
            fork.close()
    assert digest(tree) == frozen  # nothing a fork did reached the layer
    assert layers.list_layers()[0].in_use is False
    assert layers.remove([NAME]) == [NAME] and not (layer_dir / NAME).exists()
    with pytest.raises(SandboxError, match="no layer"):
        box(image, sandbox_root, [NAME])


def test_a_frozen_layer_is_kept_whole_and_its_name_is_checked(image, sandbox_root, layer_dir):
    first = box(image, sandbox_root)
    first.exec("echo one > /app/data")
    first.freeze(NAME)
    second = box(image, sandbox_root)
    second.exec("echo two > /app/data")
    second.freeze(NAME)  # a second freeze of that name keeps the first's layer
    assert (layer_dir / NAME / "tree" / "app" / "data").read_text() == "one\n"
    assert [p.name for p in layer_dir.iterdir()] == [NAME]
    with pytest.raises(SandboxError, match="not one this service makes"):
        layers.hold(["../../etc"])
    plain = BwrapSandbox(SandboxSpec(image=str(image)), "layers", {"root": str(sandbox_root)})
    try:
        with pytest.raises(SandboxError, match="writable_root"):
            plain.freeze(NAME)
    finally:
        plain.close()
