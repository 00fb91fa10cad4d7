"""The README as data, and a user's machine to run it on.

``blocks(section)`` gives the shell blocks of a README section (indented code, as the README writes
them), each as the text a user would paste. ``UserShell`` runs them the way a new user does: an
environment with nothing of the test session in it (no ``PRORL_*``, a new ``HOME``, only ``PATH``
and a locale), in a private network namespace of its own when this is root (so the README's fixed
ports, 8000 and Flower's 5555, are free whatever else the machine runs), optionally without a
working bubblewrap (a file with no execute bit bound over it in a private mount namespace).
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def sections(text: str | None = None) -> dict[str, str]:
    """Heading text (without the #s) -> the section's body, for every heading of the README."""
    text = README.read_text() if text is None else text
    out, name, lines = {}, "", []
    for line in text.splitlines():
        heading = re.match(r"#{1,6} (.+)", line)
        if heading:
            out[name] = "\n".join(lines)
            name, lines = heading.group(1).strip(), []
        else:
            lines.append(line)
    out[name] = "\n".join(lines)
    return out


def blocks(section: str, text: str | None = None) -> list[str]:
    """The indented code blocks of ``section`` (a block starts after a blank line), dedented."""
    body = sections(text)[section]
    found, current, previous_blank = [], [], True
    for line in body.splitlines():
        indented = line.startswith("    ") and line.strip()
        if indented and (current or previous_blank):
            current.append(line)
        elif current and not line.strip():
            current.append("")
        elif current:
            found.append(_dedent(current))
            current = []
        previous_blank = not line.strip()
    if current:
        found.append(_dedent(current))
    return found


def _dedent(lines: list[str]) -> str:
    width = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    return "\n".join(line[width:] for line in lines).strip("\n")


def user_env(home: Path) -> dict[str, str]:
    """What a new user's login shell has: the interpreter that runs these tests first on PATH (as
    an activated environment would put it; ``python3`` and the installed console scripts), a new
    HOME, a locale. Nothing else of the test session, above all no ``PRORL_*``."""
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": f"{Path(sys.executable).parent}:{SYSTEM_PATH}", "HOME": str(home),
            "LANG": "C.UTF-8", "TERM": "dumb"}


def _run(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@contextmanager
def private_network(address: str | None = None) -> Iterator[list[str]]:
    """argv prefix that runs a command in a new network namespace with its own loopback (and, given
    ``address``, an interface with it: a node address that is not loopback). Not root, or no
    ``ip netns``: the host's network, prefix ``[]``."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        yield []
        return
    name = f"prorl-doc-{secrets.token_hex(4)}"
    try:
        _run(["ip", "netns", "add", name])
    except (subprocess.CalledProcessError, OSError):
        yield []
        return
    try:
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        if address:
            # a veth pair with both ends inside (no dummy module on every kernel)
            _run(["ip", "-n", name, "link", "add", "node0", "type", "veth", "peer", "name", "node1"])
            _run(["ip", "-n", name, "addr", "add", f"{address}/24", "dev", "node0"])
            for dev in ("node0", "node1"):
                _run(["ip", "-n", name, "link", "set", dev, "up"])
        yield ["ip", "netns", "exec", name]
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def without_bwrap(tmp: Path) -> list[str]:
    """argv prefix: a private mount namespace in which ``bwrap`` is a file nobody may execute."""
    bwrap = shutil.which("bwrap")
    if not bwrap:
        return []
    blocker = tmp / "no-bwrap"
    blocker.write_text("")
    blocker.chmod(0o644)
    return ["unshare", "--mount", "sh", "-c", f'mount --bind {blocker} {bwrap} && exec "$@"', "sh"]
