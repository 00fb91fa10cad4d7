"""A real container registry on loopback, and images built and pushed to it without Docker.

``docker-registry`` is Debian's build of the CNCF distribution registry (``registry:2``), started
as ``docker-registry serve <config>`` on 127.0.0.1 with its storage in a temporary directory and
its access log kept, so a test can count what was fetched. Images are made with ``umoci`` (a
directory inserted as a layer) or written as an OCI layout by hand (layers given as tar bytes:
hostile ones too), and pushed with ``skopeo copy --dest-tls-verify=false``.

    def test_x(registry, python_image): ...   # fixtures (tests/conftest.py loads this module)

``python_image`` is ``docker://127.0.0.1:<port>/prorl/python:3`` — a minimal root with bash,
coreutils, the host's Python and pytest; the SWE tests may push their environment images the
same way (:func:`push_dir`).
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.rootfs import IMAGE_TOOLS, build_rootfs

TOOLS = ("docker-registry", "skopeo", "umoci")
_ACCESS = re.compile(r'"(?P<method>[A-Z]+) (?P<path>/v2/\S*) HTTP/[0-9.]+" (?P<status>\d{3})')
_SKIP_STDLIB = ("test", "tests", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3",
                "pydoc_data", "distutils", "site-packages", "dist-packages", "config-3*")
PYTEST_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "py.py", "pygments")


def missing_tools() -> list[str]:
    return [name for name in TOOLS if not shutil.which(name)]


def needs_registry_tools():
    missing = missing_tools()
    return pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)} not installed "
                              "(scripts/install-system-deps.sh installs them)")


class LocalRegistry:
    """``docker-registry serve`` on 127.0.0.1:``port``; :meth:`requests` reads its access log."""

    def __init__(self, work: Path, port: int):
        self.work = work
        self.port = port
        self.host = f"127.0.0.1:{port}"
        self.log_path = work / "registry.log"
        config = work / "config.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: false\n"
            f"storage:\n  filesystem:\n    rootdirectory: {work / 'store'}\n  delete:\n"
            f"    enabled: true\nhttp:\n  addr: {self.host}\n")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([shutil.which("docker-registry"), "serve", str(config)],
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 20
        while not self._up():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"docker-registry did not start: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.05)

    def _up(self) -> bool:
        try:
            return requests.get(f"http://{self.host}/v2/", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def ref(self, repository: str, tag: str = "latest") -> str:
        return f"docker://{self.host}/{repository}:{tag}"

    def requests(self, method: str | None = None, contains: str = "") -> list[tuple[str, str, int]]:
        """(method, path, status) of every request served so far (the registry's access log)."""
        out = []
        for match in _ACCESS.finditer(self.log_path.read_text(errors="replace")):
            if (method is None or match["method"] == method) and contains in match["path"]:
                out.append((match["method"], match["path"], int(match["status"])))
        return out

    def blob_fetches(self, repository: str) -> int:
        return len(self.requests("GET", f"/v2/{repository}/blobs/sha256:"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._log.close()


def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr[-2000:]}")


def push_layout(layout: Path, tag: str, dest: str) -> None:
    _run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci:{layout}:{tag}", dest])


def push_dir(rootfs: Path, dest: str, work: Path, env: dict[str, str] | None = None) -> None:
    """``rootfs`` as a one-layer image (umoci insert), pushed to ``dest`` (docker://...)."""
    layout = work / f"layout-{time.monotonic_ns()}"
    _run(["umoci", "init", "--layout", str(layout)])
    _run(["umoci", "new", "--image", f"{layout}:img"])
    _run(["umoci", "insert", "--rootless", "--image", f"{layout}:img", str(rootfs), "/"])
    for name, value in (env or {}).items():
        _run(["umoci", "config", "--image", f"{layout}:img", "--config.env", f"{name}={value}"])
    push_layout(layout, "img", dest)
    shutil.rmtree(layout)


def _blob(layout: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def write_layout(layout: Path, layers: list[bytes], tag: str = "img",
                 env: list[str] | None = None) -> Path:
    """An OCI image layout written by hand: each of ``layers`` (uncompressed tar bytes) gzipped
    as one layer, exactly as given (paths, modes, device nodes: nothing checked)."""
    (layout / "blobs" / "sha256").mkdir(parents=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    diff_ids = [f"sha256:{hashlib.sha256(layer).hexdigest()}" for layer in layers]
    blobs = [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
              **_blob(layout, gzip.compress(layer, mtime=0))} for layer in layers]
    config = {"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": diff_ids},
              "config": {"Env": env or ["PATH=/usr/local/bin:/usr/bin:/bin"]}}
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           **_blob(layout, json.dumps(config).encode())},
                "layers": blobs}
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        **_blob(layout, json.dumps(manifest).encode()),
        "annotations": {"org.opencontainers.image.ref.name": tag}}]}
    (layout / "index.json").write_text(json.dumps(index))
    return layout


def tar_layer(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    """Tar bytes of exactly these members (hostile names and types included)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _python() -> str:
    """The interpreter the image gets: the system's (Debian) where there is one, else this one."""
    for candidate in ("/usr/bin/python3", sys.executable):
        if os.path.exists(candidate):
            return os.path.realpath(candidate)
    raise RuntimeError("no python3 to put into the image")


def build_python_rootfs(root: Path) -> None:
    """bash, coreutils, a Python with its standard library (less tests, tkinter ...) and pytest
    with its dependencies, copied from this machine; /usr/bin/python3 is that Python."""
    python = _python()
    build_rootfs(root, IMAGE_TOOLS + (python,))
    stdlib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"],
                            capture_output=True, text=True, check=True).stdout.strip()
    target = root / stdlib.lstrip("/")
    shutil.copytree(stdlib, target, symlinks=True, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(*_SKIP_STDLIB))
    import pytest as _pytest_pkg

    site = Path(_pytest_pkg.__file__).resolve().parent.parent
    for name in PYTEST_PACKAGES:
        source = site / name
        if source.is_dir():
            shutil.copytree(source, target / name)  # with __pycache__: the root is read-only
        elif source.exists():
            shutil.copy2(source, target / name)
    alias = root / "usr" / "bin" / "python3"
    if not os.path.lexists(alias):
        os.symlink(python, alias)


@pytest.fixture(scope="session")
def registry() -> Iterator[LocalRegistry]:
    """The session's registry on the port the test operator allows (tests/conftest.py)."""
    from tests.conftest import REGISTRY_PORT

    missing = missing_tools()
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (scripts/install-system-deps.sh)")
    work = Path(tempfile.mkdtemp(prefix="prorl-test-registry-"))
    running = LocalRegistry(work, REGISTRY_PORT)
    yield running
    running.stop()
    shutil.rmtree(work, ignore_errors=True)
    cache = os.environ.get("PRORL_SANDBOX_IMAGE_CACHE", "")
    if cache.startswith("/tmp/prorl-test-image-cache-"):  # the stack's host's (tests/conftest.py)
        shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(scope="session")
def python_image(registry: LocalRegistry) -> str:
    """``docker://<registry>/prorl/python:3``: Python and pytest in a root of their own."""
    work = registry.work / "python-image"
    rootfs = work / "rootfs"
    rootfs.mkdir(parents=True)
    build_python_rootfs(rootfs)
    ref = registry.ref("prorl/python", "3")
    push_dir(rootfs, ref, work, env={"PATH": "/usr/local/bin:/usr/bin:/bin", "IMAGE_FLAVOUR": "python"})
    shutil.rmtree(rootfs)
    return ref
