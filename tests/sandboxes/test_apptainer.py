"""The singularity runtime on a real Apptainer (``-m apptainer``).

``scripts/install-apptainer.sh`` installs Debian sid's apptainer into a private prefix (the tests
skip, saying why, when it cannot); the image is a SIF that apptainer builds here from a rootfs of
the host's own tools, Python and git (cached under ~/.cache/prorl-celery/test-images by its
content). The contract every runtime passes runs on it, in this process and through a sandbox
host; then what only this runtime does (uids, cgroup limits, nothing left after close, the
environment policy, a host killed with -9), and a SWE fixture resolving through the whole
service in that SIF.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandboxes.base import Limits, SandboxSpec
from tests.rootfs import IMAGE_TOOLS, build_rootfs
from tests.sandboxes.test_contract import SPEC, test_contract, test_contract_isolation  # noqa: F401
from tests.sandboxes.test_host import create

pytestmark = pytest.mark.apptainer
REPO = Path(__file__).resolve().parents[2]
IMAGES = Path(os.path.expanduser("~/.cache/prorl-celery/test-images"))
TOOLS = IMAGE_TOOLS + ("touch", "ln", "seq", "wc", "grep", "pgrep", "basename", "dirname", "tar",
                       "git", "sed", "head", "tail", "chmod", "find", "sort", "tr", "cut", "ps",
                       "kill", "xargs", "diff", "pwd", "uname")
PYTHON = "/usr/bin/python3.11"
_SKIP_STDLIB = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data",
                "__pycache__", "config-3.11-x86_64-linux-gnu", "dist-packages", "site-packages"}
IMAGE_VERSION = "1"  # bump when the image's recipe changes


@pytest.fixture(scope="session")
def apptainer_bin() -> str:
    """The installed binary (the script is idempotent: a second run only checks it)."""
    done = subprocess.run([str(REPO / "scripts" / "install-apptainer.sh")], capture_output=True,
                          text=True, timeout=900)
    path = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode != 0 or not os.access(path, os.X_OK):
        pytest.skip(f"scripts/install-apptainer.sh could not install apptainer: {done.stderr[-800:]}")
    os.environ["PRORL_APPTAINER_BIN"] = path
    from config.settings import get_settings

    get_settings.cache_clear()
    return path


def _copy_with_libs(files: list[str], root: Path) -> None:
    """``files`` and the libraries ldd finds for them, at their own paths under ``root``."""
    wanted = set(files)
    for path in files:
        out = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
        wanted.update(part for line in out.splitlines() for part in line.split() if part.startswith("/"))
    for path in sorted(wanted):
        target = root / path.lstrip("/")
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.realpath(path), target)


def build_image_rootfs(root: Path) -> None:
    """The test image: tests/rootfs.py's tools plus a few more, Python with its standard
    library, git, and the mount points and files apptainer fills in."""
    build_rootfs(root, TOOLS)
    stdlib = Path(PYTHON.replace("/bin/", "/lib/"))  # /usr/lib/python3.11
    shutil.copytree(stdlib, root / str(stdlib).lstrip("/"), symlinks=True, dirs_exist_ok=True,
                    ignore=lambda d, names: [n for n in names if n in _SKIP_STDLIB])
    dynload = [str(p) for p in (stdlib / "lib-dynload").glob("*.so")]
    _copy_with_libs([PYTHON, *dynload], root)
    (root / "usr/bin/python3").unlink(missing_ok=True)
    os.symlink("python3.11", root / "usr/bin/python3")
    for name in ("dev", "proc", "sys", "tmp", "var/tmp", "home", "workspace", "root", "etc"):
        (root / name).mkdir(parents=True, exist_ok=True)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "etc/group").write_text("root:x:0:\n")
    for name in ("hosts", "resolv.conf"):
        (root / "etc" / name).touch()


def image_key() -> str:
    recipe = "\n".join([IMAGE_VERSION, PYTHON, *TOOLS, sys.version])
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


@pytest.fixture(scope="session")
def sif_image(apptainer_bin, tmp_path_factory) -> str:
    """A SIF built by apptainer from :func:`build_image_rootfs`, once per recipe."""
    if not os.path.exists(PYTHON):
        pytest.skip(f"the test image copies the host's {PYTHON}, which is missing")
    IMAGES.mkdir(parents=True, exist_ok=True)
    sif = IMAGES / f"python-git-{image_key()}.sif"
    if not sif.exists():
        rootfs = tmp_path_factory.mktemp("sif-rootfs")
        build_image_rootfs(rootfs)
        partial = sif.with_suffix(f".{os.getpid()}.part")
        done = subprocess.run([apptainer_bin, "--quiet", "build", "--force", "--mksquashfs-args",
                               "-comp gzip -Xcompression-level 1", str(partial), str(rootfs)],
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
        os.replace(partial, sif)
    return str(sif)


def open_box(sif_image: str, root: Path, spec: SandboxSpec | None = None, job: str = "apptainer-job"):
    from sandboxes.singularity import SingularitySandbox

    spec = (spec or SPEC).model_copy(update={"image": sif_image})
    return SingularitySandbox(spec, job, {"root": str(root)})


@pytest.fixture(params=["singularity", "remote"])
def box(request, sif_image, sandbox_root):
    """What test_contract's tests (imported above) run on: the real runtime, in this process
    and served by a sandbox host over HTTP."""
    if request.param == "remote":
        host = request.getfixturevalue("start_host")(
            runtimes="singularity", runtime_config={"singularity": {"root": str(sandbox_root)}},
            env={"PRORL_APPTAINER_BIN": os.environ["PRORL_APPTAINER_BIN"],
                 "PRORL_SANDBOX_IMAGE_DIRS": str(IMAGES)})
        sandbox = create(host, "contract-job", spec={**SPEC.model_dump(), "runtime": "singularity",
                                                     "image": sif_image})
    else:
        sandbox = open_box(sif_image, sandbox_root)
    sandbox.kind = request.param
    yield sandbox
    sandbox.close()
