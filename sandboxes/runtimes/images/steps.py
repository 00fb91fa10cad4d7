"""One stage of a build, step by step: its root made from its base, then each RUN, COPY, ADD and
WORKDIR applied inside the build sandbox (:mod:`sandboxes.runtimes.images.sandbox`). COPY, ADD and
WORKDIR run :mod:`sandboxes.runtimes.images.copier` in it with the node's own Python (through the
node's dynamic loader, so a ``scratch`` image needs no Python of its own): every path resolves
inside the image. A step that fails raises :class:`ImageBuildFailed` with the instruction and
the log's last lines."""
from __future__ import annotations

import json
import posixpath
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from prorl_celery.errors import ImageBuildFailed
from sandboxes.runtimes.images import bases, sandbox
from sandboxes.runtimes.images.plan import Stage, Step

COPIER = Path(__file__).with_name("copier.py")
TAIL_LINES = 40


@dataclass
class Build:
    """What every step of one build shares."""

    scratch: Path
    context: Path  # the snapshot of the context
    log_path: Path
    log: BinaryIO
    deadline: float
    network: str  # isolated, node or off
    who: sandbox.Identity
    build_dir: Path
    roots: dict[int, Path] = field(default_factory=dict)
    chowns: list[tuple[str, int, int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    base_of: dict[str, bases.Base] = field(default_factory=dict)
    releases: list = field(default_factory=list)  # leases on pulled images, released at the end
    counter: int = 0


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _failed(build: Build, step: Step, why: str) -> ImageBuildFailed:
    build.log.flush()
    return ImageBuildFailed(f"Dockerfile {step.where} failed: {why} (log: {build.log_path}); its last lines:\n"
                            f"{tail(build.log_path)}")


def _copy_tree(src: Path | str, dest: Path) -> None:
    done = subprocess.run(["cp", "-a", "--reflink=auto", f"{src}/.", str(dest)], capture_output=True, text=True)
    if done.returncode != 0:
        raise ImageBuildFailed(f"could not copy the base {src} into the build: {done.stderr[-500:]}")


def populate(stage: Stage, build: Build) -> Path:
    """The stage's root: a copy of its base (an earlier stage, a Debian base, a pulled image)."""
    root = build.scratch / f"stage-{stage.index}"
    root.mkdir(mode=0o755)
    if stage.base_stage is not None:
        _copy_tree(build.roots[stage.base_stage], root)
    elif stage.from_ref != "scratch":
        _copy_tree(_base_root(build.base_of[stage.from_ref], build), root)
    base = build.base_of.get(stage.from_ref)
    if base is not None and base.python_flavour and stage.base_stage is None:
        for marker in root.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
            marker.unlink()
    sandbox.give(root, build.who)
    build.roots[stage.index] = root
    build.chowns = []  # only the last stage's are the image's
    return root


def _base_root(base: bases.Base, build: Build) -> str:
    if base.kind == "debian":
        return str(bases.ensure_debian(base, build.build_dir, build.deadline))
    if base.kind == "toolkit":
        return str(bases.ensure_toolkit(base, build.build_dir, build.deadline))
    if base.kind == "scratch":
        empty = build.scratch / "empty"
        empty.mkdir(exist_ok=True)
        return str(empty)
    rootfs, _env, release = bases.pulled_rootfs(base, build.deadline)
    build.releases.append(release)
    return rootfs


def apply(stage: Stage, step: Step, build: Build) -> None:
    root = build.roots[stage.index]
    header = f"\n#### {step.where}: {' '.join(step.argv)[:300] if step.kind == 'run' else step.kind}\n"
    build.log.write(header.encode())
    build.log.flush()
    if step.kind == "run":
        _run(root, step, build)
    elif step.kind == "workdir":
        _copier(root, {"mkdir": step.workdir}, [], step, build)
    else:
        _copy(stage, root, step, build)


def _network(step: Step, build: Build) -> str:
    return "off" if step.network is False else build.network


def _run(root: Path, step: Step, build: Build) -> None:
    _copier(root, {"mkdir": step.workdir}, [], step, build)
    binds, argv = [], step.argv
    if step.script is not None:
        script = build.scratch / f"script-{build.counter}"
        build.counter += 1
        script.write_text(step.script)
        script.chmod(0o755)
        binds.append((str(script), "/dev/prorl/script"))
        argv = ["/dev/prorl/script"]
    env = {"HOME": "/root", **step.env}  # as Docker's RUN, for root
    command = sandbox.argv_for(root, argv, env, step.workdir, _network(step, build), binds, build.who)
    try:
        code = sandbox.run(command, build.log, build.deadline, _network(step, build), step.where, build.who)
    except ImageBuildFailed as exc:
        raise _failed(build, step, str(exc).split(": ", 1)[-1]) from None
    if code != 0:
        raise _failed(build, step, f"exit status {code}")


def _copier(root: Path, spec: dict, binds: list[tuple[str, str]], step: Step, build: Build,
            network: str = "off") -> dict:
    spec_path = build.scratch / f"copy-{build.counter}.json"
    build.counter += 1
    spec_path.write_text(json.dumps(spec))
    binds = [("/usr", "/dev/prorl/usr"), (str(COPIER), "/dev/prorl/copier.py"),
             (str(spec_path), "/dev/prorl/spec.json"), *binds]
    env = {"PYTHONHOME": "/dev/prorl/usr", "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8",
           "SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt"}  # the image's CAs, for ADD <url>
    argv = ["/dev/prorl" + sandbox.LOADER, "--library-path", "/dev/prorl" + sandbox.LIBS, sandbox.HOST_PY,
            "-I", "/dev/prorl/copier.py", "/dev/prorl/spec.json"]
    out_path = build.scratch / f"copy-{build.counter}.out"
    with open(out_path, "wb") as out:
        command = sandbox.argv_for(root, argv, env, "/", network, binds, build.who)
        try:
            code = sandbox.run(command, build.log, build.deadline, network, step.where, build.who, stdout=out)
        except ImageBuildFailed as exc:
            raise _failed(build, step, str(exc).split(": ", 1)[-1]) from None
    if code != 0:
        raise _failed(build, step, f"{step.kind} failed (exit {code})")
    text = out_path.read_text().strip()
    return json.loads(text) if text else {}


def _inside(base: str, pattern: str, step: Step) -> str:
    rel = posixpath.normpath("/" + pattern).lstrip("/")
    return f"{base}/{rel}" if rel not in ("", ".") else base


def _copy(stage: Stage, root: Path, step: Step, build: Build) -> None:
    sources, binds = [], []
    if step.from_stage is not None or step.from_image:
        source_root = build.roots[step.from_stage] if step.from_stage is not None else \
            Path(_base_root(build.base_of[step.from_image], build))
        binds.append((str(source_root), "/dev/prorl/from"))
        base = "/dev/prorl/from"
    else:
        binds.append((str(build.context), "/dev/prorl/ctx"))
        base = "/dev/prorl/ctx"
    for source in step.sources:
        if source.startswith(("http://", "https://")):
            if step.kind != "add":
                raise ImageBuildFailed(f"Dockerfile {step.where}: COPY cannot fetch {source}; use ADD")
            if build.network == "off":
                raise ImageBuildFailed(f"Dockerfile {step.where}: ADD {source} needs the network and the build "
                                       "has none (PRORL_IMAGE_BUILD_NETWORK=off)")
            sources.append(source)
        elif source.startswith(("git@", "git://")) or source.endswith(".git"):
            raise ImageBuildFailed(f"Dockerfile {step.where}: ADD of a git repository ({source}) is not supported")
        else:
            sources.append(_inside(base, source, step))
    spec = {"sources": sources, "inline": step.inline, "dest": step.dest, "add": step.kind == "add",
            "chmod": step.chmod, "chown": step.chown, "checksum": step.checksum}
    network = build.network if any(s.startswith("http") for s in sources) else "off"
    result = _copier(root, spec, binds, step, build, network=network)
    uid, gid = result.get("uid"), result.get("gid")
    if uid is not None and (uid, gid) != (0, 0):
        if build.who.owner is None:
            stage.notes.append(f"{step.where} --chown={step.chown}: not applied (the builder is not root)")
        else:
            build.chowns += [(path, uid, gid) for path in result.get("written", [])]
