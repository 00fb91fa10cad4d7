"""A rootfs directory built from a few host tools and their libraries, for image tests: a root
that is not the host's, with a marker file (``/etc/image-marker``) to prove which root a sandbox saw."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

IMAGE_TOOLS = ("bash", "sh", "cat", "ls", "mkdir", "rm", "mv", "cp", "env", "id", "sleep", "true", "stat")


def build_rootfs(path: Path, tools: tuple[str, ...] = IMAGE_TOOLS) -> None:
    binaries = [found for name in tools if (found := shutil.which(name))]
    files = set(binaries)
    for binary in binaries:
        for line in subprocess.run(["ldd", binary], capture_output=True, text=True).stdout.splitlines():
            files.update(part for part in line.split() if part.startswith("/"))
    for source in files:
        real = os.path.realpath(source)
        (path / real.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(real, path / real.lstrip("/"))
        # the names the binaries use (e.g. /lib64/ld-linux-x86-64.so.2) lead to the copies
        for alias in {source, os.path.join(os.path.realpath(os.path.dirname(source)), os.path.basename(source))}:
            target = path / alias.lstrip("/")
            if not os.path.lexists(target):
                target.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(real, target)
    for name in ("bin", "lib", "lib64", "sbin"):
        if os.path.islink(f"/{name}") and not os.path.lexists(path / name):
            os.symlink(os.readlink(f"/{name}"), path / name)
    (path / "etc").mkdir(exist_ok=True)
    (path / "etc" / "image-marker").write_text("from the image\n")
