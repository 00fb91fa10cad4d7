"""Dockerfiles built into rootless images (sandboxes/runtimes/images/build.py): a real Debian
base by mmdebstrap (built once, cached in the default image build directory between runs), real
builds in bwrap, real apt. Each test's Dockerfile carries a fresh comment, so its image is built
anew while the base stays cached."""
from __future__ import annotations

import os
import shutil
import stat
import tarfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from config.settings import get_settings
from prorl_celery.errors import ImageBuildFailed
from sandboxes.runtimes.images import build as builder
from sandboxes.runtimes.images.build import ensure_built
from sandboxes.runtimes.images.finish import MOUNT_POINTS

pytestmark = [
    pytest.mark.harbor,
    pytest.mark.skipif(not (shutil.which("mmdebstrap") and shutil.which("bwrap")),
                       reason="needs mmdebstrap and bwrap (scripts/install-system-deps.sh)"),
]

COOKBOOK_LIKE = ("FROM ubuntu:24.04\n"
                 "RUN apt-get update && apt-get install -y --no-install-recommends jq && rm -rf /var/lib/apt/lists/*\n"
                 "WORKDIR /app\nCOPY x.txt /app/\nENV FOO=bar\n")


_CONTEXTS: list[Path] = []


@pytest.fixture(autouse=True)
def _remove_built_images():
    """Each test's images are its own (a fresh key); the Debian base stays for the next run."""
    yield
    while _CONTEXTS:
        context = _CONTEXTS.pop()
        try:
            where = builder.image_key(context)[1]
        except ImageBuildFailed:
            continue
        for path in (where, where.with_suffix(".json"), where.with_suffix(".log"), where.with_suffix(".lock")):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif path.exists():
                path.unlink()
    get_settings.cache_clear()  # a test's monkeypatched settings may be undone only after this


def _context(tmp_path: Path, dockerfile: str, **files: str) -> Path:
    context = tmp_path / f"ctx-{uuid.uuid4().hex[:8]}"
    _CONTEXTS.append(context)
    context.mkdir()
    (context / "Dockerfile").write_text(f"# test run {uuid.uuid4().hex}\n{dockerfile}")
    for name, text in files.items():
        (context / name).write_text(text)
    return context


def test_cookbook_like_dockerfile_builds_and_is_cached(tmp_path):
    context = _context(tmp_path, COOKBOOK_LIKE, **{"x.txt": "hello\n"})
    before = builder.builds
    image = ensure_built(context)
    root = Path(image.rootfs)
    assert builder.builds == before + 1
    assert os.access(root / "usr" / "bin" / "jq", os.X_OK)
    assert (root / "app" / "x.txt").read_text() == "hello\n"
    assert image.env["FOO"] == "bar" and "/usr/bin" in image.env["PATH"] and image.workdir == "/app"
    assert image.from_ref == "ubuntu:24.04" and "debian:bookworm" in image.base and "ubuntu:24.04" in image.base
    assert "ubuntu:24.04 built as debian:bookworm" in image.notes
    meta = (root / "etc" / "prorl-image.json").read_text()
    assert '"ubuntu:24.04 built as debian:bookworm"' in meta and image.key in meta
    for point in MOUNT_POINTS:
        assert (root / point).is_dir() and not (root / point).is_symlink(), point
    assert (root / "etc" / "resolv.conf").is_file()
    assert not [p for p in (root / "dev").iterdir()  # mmdebstrap's device nodes are gone
                if stat.S_ISCHR(os.lstat(p).st_mode) or stat.S_ISBLK(os.lstat(p).st_mode)]
    assert os.stat(root / "usr" / "bin" / "jq").st_uid == 0 and os.stat(root / "app" / "x.txt").st_uid == 0
    bases = {os.stat(p).st_ino for p in root.parent.glob("bases/debian-bookworm-*/usr/bin/bash")}
    assert os.stat(root / "usr" / "bin" / "bash").st_ino in bases  # shared with the base, not copied
    log_mtime = os.stat(image.log).st_mtime_ns

    again = ensure_built(context)
    assert again.rootfs == image.rootfs and again.built_at == image.built_at
    assert builder.builds == before + 1  # nothing built the second time
    assert os.stat(image.log).st_mtime_ns == log_mtime


def test_two_concurrent_callers_build_once(tmp_path):
    context = _context(tmp_path, "FROM debian:bookworm\nRUN cat /proc/sys/kernel/random/uuid > /id && sleep 1\n")
    before = builder.builds
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(ensure_built(context))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert len(results) == 2 and results[0].rootfs == results[1].rootfs
    assert builder.builds == before + 1
    assert len((Path(results[0].rootfs) / "id").read_text().strip()) == 36


def test_failing_run_raises_with_the_logs_tail(tmp_path):
    marker = f"before-the-failure-{uuid.uuid4().hex[:6]}"
    context = _context(tmp_path, f"FROM debian:bookworm\nRUN true\nRUN echo {marker} && exit 3\n")
    with pytest.raises(ImageBuildFailed) as info:
        ensure_built(context)
    text = str(info.value)
    assert "line 4 (RUN)" in text and "exit status 3" in text and marker in text
    key = builder.image_key(context)[1]
    assert not key.exists()  # nothing half-built is left in place


def _running(needle: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if needle in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_build_past_its_timeout_fails_and_leaves_no_process(tmp_path):
    duration = f"60.{uuid.uuid4().int % 10**6:06d}"  # one no other process runs
    context = _context(tmp_path, f"FROM debian:bookworm\nRUN sleep {duration} & sleep {duration}\n")
    started = time.monotonic()
    with pytest.raises(ImageBuildFailed, match="line 3 \\(RUN\\).*timeout"):
        ensure_built(context, timeout_s=6)
    assert time.monotonic() - started < 30
    assert _running(f"sleep {duration}") == []


def test_unmapped_from_without_registry_access_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PRORL_SANDBOX_REGISTRIES", "")
    get_settings.cache_clear()
    try:
        context = _context(tmp_path, "FROM ghcr.io/x/y\nRUN true\n")
        with pytest.raises(ImageBuildFailed) as info:
            ensure_built(context)
    finally:
        get_settings.cache_clear()
    text = str(info.value)
    assert "ghcr.io/x/y" in text and "PRORL_IMAGE_BASE_MAP" in text and "PRORL_SANDBOX_REGISTRIES" in text
    assert "line 2 (FROM" in text


def test_multi_stage_scratch_add_tar_chown_and_links(tmp_path):
    name = f"marker-{uuid.uuid4().hex[:8]}.txt"
    dockerfile = ("FROM debian:bookworm AS build\nRUN mkdir /out && echo built > /out/f && test ! -e /work\n"
                  "FROM debian:bookworm\nCOPY --from=build /out /from-build\nADD bundle.tar.gz /unpacked/\n"
                  "COPY --chown=1000:1000 --chmod=640 owned.txt /o/\n"
                  f"RUN ln -s /etc /hostetc\nCOPY {name} /hostetc/\nCOPY <<EOF /etc/inline\nv=$HOSTNAME\nEOF\n"
                  f"RUN --network=none ln -sf /tmp/{name} /etc/resolv.conf\nRUN true\n"
                  'SHELL ["/bin/bash", "-c"]\nRUN [[ -n "$BASH_VERSION" ]] && echo bash > /shell\nUSER nobody\n')
    context = _context(tmp_path, dockerfile, **{"owned.txt": "mine\n", name: "inside the image\n"})
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "in-tar.txt").write_text("from the tar\n")
    with tarfile.open(context / "bundle.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "t" / "in-tar.txt", arcname="sub/in-tar.txt")
    image = ensure_built(context)
    root = Path(image.rootfs)
    assert (root / "from-build" / "f").read_text() == "built\n"
    assert (root / "unpacked" / "sub" / "in-tar.txt").read_text() == "from the tar\n"
    owned = os.stat(root / "o" / "owned.txt")
    assert (owned.st_uid, owned.st_gid, owned.st_mode & 0o777) == (1000, 1000, 0o640)
    assert (root / "etc" / name).read_text() == "inside the image\n"  # the link resolved in the image
    assert not Path("/etc", name).exists()  # never on the host
    assert not Path("/tmp", name).exists() and (root / "etc" / "resolv.conf").is_file()
    assert not (root / "etc" / "resolv.conf").is_symlink()
    assert (root / "etc" / "inline").read_text() == "v=\n"
    assert (root / "shell").read_text() == "bash\n"
    assert image.user == "nobody" and any("USER nobody" in note for note in image.notes)


def test_from_scratch_gets_its_mount_points(tmp_path):
    context = _context(tmp_path, "FROM scratch\nCOPY a.txt /a.txt\n", **{"a.txt": "a\n"})
    image = ensure_built(context)
    root = Path(image.rootfs)
    assert (root / "a.txt").read_text() == "a\n"
    assert all((root / point).is_dir() for point in MOUNT_POINTS)
    assert image.base == "scratch" and image.env["PATH"]


def test_unmapped_from_is_pulled_from_an_allowed_registry(tmp_path, registry):
    from tests.registry import push_layout, tar_layer, write_layout

    info = tarfile.TarInfo("hello.txt")
    layer = tar_layer([(info, b"from the registry\n")])
    ref = registry.ref("prorl/build-base", "1")
    push_layout(write_layout(tmp_path / "layout", [layer]), "img", ref)
    context = _context(tmp_path, f"FROM {ref.removeprefix('docker://')}\nCOPY a.txt /a.txt\n", **{"a.txt": "a\n"})
    image = ensure_built(context)
    root = Path(image.rootfs)
    assert (root / "hello.txt").read_text() == "from the registry\n" and (root / "a.txt").read_text() == "a\n"
    assert image.base.endswith("(pulled)") and "sha256:" in image.base


def test_packages_may_chown_to_users_of_their_own(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a host that is not root maps one uid into the build")
    context = _context(tmp_path, "FROM debian:bookworm\nRUN useradd -m -u 1234 app && touch /home/app/f && "
                                 "chown app:app /home/app/f && runuser -u app -- touch /home/app/g\n")
    root = Path(ensure_built(context).rootfs)
    made = os.stat(root / "home" / "app" / "g")
    assert (made.st_uid, made.st_gid) == (0, 0)  # built as app inside, given to root afterwards
    assert "app:x:1234" in (root / "etc" / "passwd").read_text()


def test_the_builds_network_never_reaches_the_nodes_own_addresses(tmp_path):
    import socket

    from sandboxes.runtimes.limits import netns

    addresses = [a.split("/")[0] for a in netns.host_addresses() if not a.startswith("127.")]
    if not addresses:
        pytest.skip("the node has no address beyond loopback")
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        probe = f"import socket; socket.create_connection(('{addresses[0]}', {port}), timeout=3)"
        context = _context(tmp_path, f'FROM debian:bookworm\nRUN ! python3 -c "{probe}" && echo refused > /probe\n')
        image = ensure_built(context)
    assert (Path(image.rootfs) / "probe").read_text() == "refused\n"


def test_add_url_fetches_with_the_builds_network_and_is_refused_without(tmp_path):
    url = "https://deb.debian.org/debian/dists/bookworm/Release"
    context = _context(tmp_path, f"FROM debian:bookworm\nADD {url} /release\n")
    with pytest.raises(ImageBuildFailed, match=f"line 3 \\(ADD\\): ADD {url} needs the network"):
        ensure_built(context, network=False)
    image = ensure_built(context)
    release = Path(image.rootfs) / "release"
    assert release.read_text().startswith("Origin: Debian") and release.stat().st_mode & 0o777 == 0o600


def test_a_killed_builder_leaves_no_build_process(tmp_path):
    import signal
    import subprocess
    import sys

    duration = f"61.{uuid.uuid4().int % 10**6:06d}"
    context = _context(tmp_path, f"FROM debian:bookworm\nRUN sleep {duration}\n")
    root = Path(__file__).resolve().parents[2]
    builder_proc = subprocess.Popen([sys.executable, "-m", "sandboxes.runtimes.images.build", str(context)],
                                    cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not _running(f"sleep {duration}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _running(f"sleep {duration}"), "the RUN never started"
    finally:
        builder_proc.send_signal(signal.SIGKILL)
        builder_proc.wait()
    deadline = time.monotonic() + 10
    while _running(f"sleep {duration}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(f"sleep {duration}") == []
