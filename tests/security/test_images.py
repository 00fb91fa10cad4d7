"""Attacks on docker:// images (issue 12 with the image policy of issue 10): hostile references,
registries the operator did not list, a TLS downgrade, hostile layers (``..`` and absolute paths,
writes through a planted symlink, a hard link to a host file, device nodes, setuid files), and a
sandbox writing to the image the next sandbox runs in. Real registry, skopeo, umoci and bwrap."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest
import requests

from prorl_celery.errors import ImageUnavailable, InvalidRequest, PolicyDenied
from sandboxes.policy import check_image
from sandboxes.runtimes.images.cache import ImageCache
from sandboxes.images import check_reference
from sandboxes.safedirs import UnsafeDirectory
from tests.conftest import REDIS_PORT
from tests.registry import LocalRegistry, needs_registry_tools, push_layout, tar_layer, write_layout
from tests.sandboxes.conftest import needs_bwrap, sandbox_redis, sandbox_root, start_host  # noqa: F401
from tests.helpers import reachable_tmpdir

pytestmark = [needs_bwrap(), needs_registry_tools()]
IMAGES = f"/tmp/prorl-test-images-{REDIS_PORT}"  # the test operator's PRORL_SANDBOX_IMAGE_DIRS

HOSTILE = [
    "docker://evil/../../etc/passwd", "docker://127.0.0.1:1/../../x", "docker:///etc/passwd",
    "docker://-v/x", "docker://--insecure-policy", "docker://host/--src-creds=a:b",
    "docker://host/repo:-tag", "docker://host/repo:tag --src-creds=a:b", "docker://host/repo\n:tag",
    "docker://host/Repo:tag", "docker://host/repo//x", "docker://host/repo@sha256:abc",
    "docker://host/repo@md5:" + "0" * 32, "docker://host:99999x/repo", "docker://ho$t/repo",
    "docker://host/" + "a" * 300, "docker://host/repo:" + "t" * 129, "docker://host/./repo",
    "oci:relative/layout:x", "oci:/etc:passwd", f"oci:{IMAGES}/../../etc:x", "oci:/a:b:c",
]


def settings_env(monkeypatch, **env: str) -> None:
    from config.settings import get_settings

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()


@pytest.fixture(autouse=True)
def _fresh_settings():
    from config.settings import get_settings

    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@pytest.fixture
def cache_dir():
    yield from reachable_tmpdir("prorl-test-imgcache-")


@pytest.mark.unit
@pytest.mark.parametrize("image", HOSTILE)
def test_hostile_references_are_refused_naming_the_field(image, monkeypatch):
    settings_env(monkeypatch, PRORL_SANDBOX_REGISTRIES="host,evil,127.0.0.1:1,host:99999x")
    with pytest.raises(InvalidRequest) as caught:
        check_image(image, "instance.sandbox.image")
    assert caught.value.field == "instance.sandbox.image"


@pytest.mark.unit
def test_what_passes_is_one_argument_that_is_never_an_option(monkeypatch):
    settings_env(monkeypatch, PRORL_SANDBOX_REGISTRIES="docker.io,127.0.0.1:5000")
    for image, canonical in [
            ("docker://python:3.11", "docker://docker.io/library/python:3.11"),
            ("docker://index.docker.io/org/x", "docker://docker.io/org/x:latest"),
            ("docker://127.0.0.1:5000/a/b-c__d.e:v_1.2-rc", "docker://127.0.0.1:5000/a/b-c__d.e:v_1.2-rc")]:
        ref = check_reference(image)
        assert ref.canonical == canonical and check_image(image) == canonical
        assert ref.skopeo().startswith("docker://") and " " not in ref.skopeo()


@pytest.mark.unit
def test_the_allow_list_is_exact_about_ports_and_paths(monkeypatch):
    settings_env(monkeypatch, PRORL_SANDBOX_REGISTRIES="127.0.0.1,ghcr.io/trusted-org")
    with pytest.raises(PolicyDenied, match="PRORL_SANDBOX_REGISTRIES"):
        check_reference("docker://127.0.0.1:5000/x:1")  # the host without its port is not enough
    assert check_reference("docker://ghcr.io/trusted-org/env/py:3").registry == "ghcr.io"
    for image in ("docker://ghcr.io/trusted-org-evil/x:1", "docker://ghcr.io/other/x:1",
                  "docker://python:3", "docker://ghcr.io.evil.example/trusted-org/x:1"):
        with pytest.raises(PolicyDenied):
            check_reference(image)
    settings_env(monkeypatch, PRORL_SANDBOX_REGISTRIES="")
    with pytest.raises(PolicyDenied, match="none"):  # empty: no registry at all
        check_reference("docker://ghcr.io/trusted-org/x:1")


@pytest.mark.parametrize("image", [
    "docker-archive:/etc/shadow", "oci-archive:/root/x.tar", "docker-daemon:python:3",
    "library://evil/x:1", "oras://evil.example/x:1", "shub://evil/x", "https://evil.example/x.sif"])
@pytest.mark.unit
def test_transports_outside_the_allow_list_are_refused(image, monkeypatch, tmp_path):
    """docker-archive: would have singularity read any host file; library:// and oras:// reach
    registries PRORL_SANDBOX_REGISTRIES never listed: none of them passes to a runtime."""
    settings_env(monkeypatch, PRORL_SANDBOX_REGISTRIES="evil,evil.example,docker.io",
                 PRORL_SANDBOX_IMAGE_DIRS=str(tmp_path))
    with pytest.raises(PolicyDenied) as caught:
        check_image(image, "instance.sandbox.image")
    assert caught.value.field == "instance.sandbox.image"


def test_the_api_refuses_hostile_and_unlisted_images(api):
    for image in ("docker://evil/../../etc", "docker://127.0.0.1:1/x:1", "docker://python:3",
                  "oci:/etc:passwd", "docker://x/y:z; rm -rf /"):
        instance = {"data_source": "shell", "commands": ["true"],
                    "sandbox": {"runtime": "bwrap", "image": image}}
        response = requests.post(f"{api}/jobs", json={"instance": instance}, timeout=10)
        assert response.status_code in (400, 403), (image, response.text)
        assert response.json()["error"]["field"] == "instance.sandbox.image"


def test_no_silent_tls_downgrade(registry, python_image, cache_dir, monkeypatch):
    settings_env(monkeypatch, PRORL_SANDBOX_INSECURE_REGISTRIES="")  # listed, but TLS required
    cache = ImageCache(cache_dir, 1024, 30, 0)
    with pytest.raises(ImageUnavailable, match="HTTPS"):
        cache.acquire(check_reference(python_image))
    assert cache.images() == []


@pytest.mark.unit
def test_a_symlinked_or_foreign_cache_directory_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(UnsafeDirectory):
        ImageCache(tmp_path / "link", 1024, 30, 0)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(UnsafeDirectory):
        ImageCache(open_dir, 1024, 30, 0)


# -- hostile layers ------------------------------------------------------------------------------
def _m(name: str, type_: bytes = tarfile.REGTYPE, mode: int = 0o644, linkname: str = "",
       data: bytes | None = None, major: int = 0) -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname, info.devmajor = type_, mode, linkname, major
    return info, data if data is not None or type_ != tarfile.REGTYPE else b"x"


def _push(registry: LocalRegistry, repository: str, layers: list[bytes]) -> str:
    work = Path(tempfile.mkdtemp(prefix="prorl-test-hostile-"))
    ref = registry.ref(repository, "1")
    push_layout(write_layout(work / "layout", layers), "img", ref)
    subprocess.run(["rm", "-rf", str(work)], check=False)
    return ref


def test_hostile_layers_stay_inside_the_rootfs_and_lose_their_privileges(registry, cache_dir):
    outside = Path(tempfile.mkdtemp(prefix="prorl-test-outside-"))
    escapes = [Path(f"/tmp/prorl-escape-{os.getpid()}-{kind}") for kind in ("dotdot", "abs")]
    layer = tar_layer([
        _m(f"../../../../..{escapes[0]}"), _m(str(escapes[1])),
        _m("link", tarfile.SYMTYPE, linkname=str(outside)), _m("link/planted"),
        _m("dev/kmem", tarfile.CHRTYPE, 0o666, major=1), _m("disk", tarfile.BLKTYPE, 0o666, major=8),
        _m("fifo", tarfile.FIFOTYPE), _m("bin", tarfile.DIRTYPE, 0o755),
        _m("bin/suid", mode=0o4755), _m("bin/sgid", mode=0o2755), _m("shared", tarfile.DIRTYPE, 0o3777),
        _m("everyone-writes", mode=0o666), _m("owner-only", mode=0o600)])
    ref = check_reference(_push(registry, "prorl/hostile", [layer]))
    cache = ImageCache(cache_dir, 1024, 60, 0)
    lease = cache.acquire(ref)
    root = Path(lease.rootfs)
    try:
        assert not any(path.exists() for path in escapes) and list(outside.iterdir()) == []
        assert (root / escapes[0].relative_to("/")).exists()  # rooted inside, not outside
        assert (root / "link").is_symlink() and (root / outside.relative_to("/") / "planted").exists()
        for directory, dirs, files in os.walk(root):
            for name in dirs + files:
                st = os.lstat(os.path.join(directory, name))
                if stat.S_ISLNK(st.st_mode):
                    continue
                assert stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode), name  # no fifo, device
                assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX | 0o022), name
        assert not (root / "fifo").exists()
        assert (root / "dev" / "kmem").stat().st_size == 0  # umoci rootless: an empty file
        assert stat.S_IMODE((root / "owner-only").stat().st_mode) == 0o644
    finally:
        lease.release()
        subprocess.run(["rm", "-rf", str(outside), *map(str, escapes)], check=False)


def test_a_hard_link_to_a_host_file_fails_the_pull_typed(registry, cache_dir):
    layer = tar_layer([_m("passwd", tarfile.LNKTYPE, linkname="/etc/passwd")])
    ref = check_reference(_push(registry, "prorl/hardlink", [layer]))
    cache = ImageCache(cache_dir, 1024, 60, 0)
    with pytest.raises(ImageUnavailable, match="unpacking"):
        cache.acquire(ref)
    assert cache.images() == []


def test_a_sandbox_cannot_change_the_image_or_use_its_setuid_files(start_host, registry, python_image,
                                                                   cache_dir, tmp_path):
    layout, extra = tmp_path / "layout", tmp_path / "extra"
    subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false", python_image,
                    f"oci:{layout}:img"], check=True)
    (extra / "usr" / "bin").mkdir(parents=True)
    shell = extra / "usr" / "bin" / "rootshell"
    shell.write_bytes(Path("/bin/bash").read_bytes())
    shell.chmod(0o4755)
    subprocess.run(["umoci", "insert", "--rootless", "--image", f"{layout}:img", str(extra), "/"], check=True)
    image = registry.ref("prorl/suid-python", "1")
    push_layout(layout, "img", image)
    host = start_host(runtimes="bwrap", env={"PRORL_SANDBOX_IMAGE_CACHE": str(cache_dir)})
    headers = {"Authorization": f"Bearer {host.token}"}
    created = requests.post(f"{host.address}/sandboxes", headers=headers, timeout=120, json={
        "job_id": "attack", "spec": {"runtime": "bwrap", "image": image}})
    assert created.status_code == 201, created.text
    sandbox = created.json()["sandbox_id"]

    def run(command: str) -> dict:
        return requests.post(f"{host.address}/sandboxes/{sandbox}/exec", headers=headers, timeout=60,
                             json={"command": command, "timeout": 30}).json()

    assert run("echo pwned > /etc/image-marker")["exit_code"] != 0
    assert run("rm -f /usr/bin/python3 || true; test -e /usr/bin/python3")["exit_code"] == 0
    assert run("stat -c %a /usr/bin/rootshell")["output"].strip() == "755"
    requests.delete(f"{host.address}/sandboxes/{sandbox}", headers=headers, timeout=30)
    digest = created.json()["info"]["image_digest"].split(":")[1]
    rootfs = cache_dir / "images" / digest / "rootfs"
    assert (rootfs / "etc" / "image-marker").read_text() == "from the image\n"
    assert not (rootfs / "usr" / "bin" / "rootshell").stat().st_mode & stat.S_ISUID
    json.loads((cache_dir / "images" / digest / "meta.json").read_text())  # intact
