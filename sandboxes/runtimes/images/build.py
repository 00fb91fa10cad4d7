"""Dockerfiles to rootless images, without a Docker daemon: :func:`ensure_built`.

A Dockerfile and its context become one rootfs directory, ``<image_build_dir>/img-<key>``:

- The key is a sha256 of the builder's version, the Dockerfile's text, the build args, every
  context file COPY/ADD could read (path, mode, content; the whole directory minus what
  ``.dockerignore`` excludes) and the key of every base it starts from
  (:mod:`sandboxes.runtimes.images.bases`: a Debian root by suite, packages and mirror, or a
  pulled image's digest).
- Built once per key per directory: every process and every node reading the directory waits on
  one ``flock`` and finds the image; it is built in a temporary directory and renamed into place
  whole, so a half-built image is never seen. The log stays beside it (``img-<key>.log``).
- The steps (:mod:`sandboxes.runtimes.images.plan`, :mod:`~sandboxes.runtimes.images.steps`)
  run in a bwrap sandbox whose writable root is the image, as fake root
  (:mod:`sandboxes.runtimes.images.sandbox`); a failure, or a build past ``timeout_s``, raises
  :class:`ImageBuildFailed` with the failing instruction and the log's last lines.
- Every image has the mount points sandboxes bind over (:mod:`~sandboxes.runtimes.images.finish`)
  and ``/etc/prorl-image.json``, the :class:`BuiltImage` it was returned as. Its files equal to
  its Debian base's are hard links to them: an image costs the disk what its steps changed.
  Built images are never evicted here (remove ``img-<key>*`` to rebuild).

CLI: ``python -m sandboxes.runtimes.images.build DIR [--dockerfile F] [--build-arg K=V]...``
prints the rootfs directory (``--key``: the key and where the image is or would be).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from prorl_celery.errors import ImageBuildFailed, ProrlError
from sandboxes.runtimes.images import bases, context as ctx, finish, sandbox, steps
from sandboxes.runtimes.images.locks import locked
from sandboxes.runtimes.images.plan import DEFAULT_PATH, ImageConfig, Plan, plan
from sandboxes.safedirs import remove_tree

__all__ = ["BuiltImage", "ImageBuildFailed", "build_dir", "ensure_built", "image_key", "main"]

BUILDER_VERSION = "1"
builds = 0  # images this process built (not found built): the tests' evidence of "built once"


class BuiltImage(BaseModel):
    """A built image: its rootfs and what the Dockerfile said of it."""

    model_config = ConfigDict(extra="forbid")

    rootfs: str
    key: str
    env: dict[str, str]
    workdir: str = "/"
    user: str | None = None
    from_ref: str
    base: str  # what it was really built from, e.g. "debian:bookworm (mmdebstrap) for ubuntu:24.04"
    notes: list[str] = []  # what was not honoured as written
    log: str
    config: ImageConfig = ImageConfig()
    built_at: float = 0.0
    build_s: float = 0.0


def _settings():
    from config.settings import get_settings

    return get_settings()


def build_dir() -> Path:
    """``image_build_dir``, or its default (a root host's in /var/cache: the build and sandbox
    uids cannot enter root's home)."""
    from sandboxes.dirs import image_build_dir

    return image_build_dir()


def _make_dir(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o711)
    if os.geteuid() == 0:
        closed = [str(p) for p in root.resolve().parents if not os.stat(p).st_mode & 0o001]
        if closed:
            raise ImageBuildFailed(f"image build directory {root} is beneath {closed[0]}, which the build and "
                                   "sandbox uids cannot enter (set PRORL_IMAGE_BUILD_DIR elsewhere)")


def _network(network: bool | None) -> str:
    mode = _settings().image_build_network
    if network is False:
        return "off"
    if network is True and mode == "off":
        raise ImageBuildFailed("this build needs the network and PRORL_IMAGE_BUILD_NETWORK is off")
    if mode == "isolated":
        from sandboxes.runtimes.limits import netns

        missing = [name for name in ("slirp4netns", "nft", "nsenter") if not netns.tool(name)]
        if missing:
            raise ImageBuildFailed(f"PRORL_IMAGE_BUILD_NETWORK=isolated needs {', '.join(missing)} on this node "
                                   "(scripts/install-system-deps.sh), or set it to node or off")
    return mode


class _Prepared(BaseModel):
    model_config = ConfigDict(extra="forbid")

    plan: Plan
    base_of: dict[str, bases.Base]
    files: list[str]
    key: str


def _prepare(context: Path, text: str, build_args: dict[str, str], deadline: float) -> _Prepared:
    found: dict[str, bases.Base] = {}

    def base_env(ref: str) -> dict[str, str]:
        found.setdefault(ref, bases.resolve(ref, deadline))
        return found[ref].env or {"PATH": DEFAULT_PATH}

    planned = plan(text, build_args, base_env)
    for ref in planned.external_refs():
        if ref not in found:
            try:
                found[ref] = bases.resolve(ref, deadline)
            except ImageBuildFailed as exc:
                raise ImageBuildFailed(f"Dockerfile {planned.where_used(ref)}: {exc}") from None
    files = ctx.files(context)
    h = hashlib.sha256()
    for part in (f"builder={BUILDER_VERSION}", text, json.dumps(sorted(build_args.items())),
                 ctx.digest(context, files), *(f"{ref}={found[ref].key}" for ref in planned.external_refs())):
        h.update(part.encode() + b"\0")
    return _Prepared(plan=planned, base_of=found, files=files, key=h.hexdigest())


def image_key(context: Path, dockerfile: Path | None = None, *, build_args: dict[str, str] | None = None,
              root: Path | None = None) -> tuple[str, Path]:
    """(key, rootfs directory) the build of ``context`` has, built or not."""
    context = Path(context)
    text = Path(dockerfile or context / "Dockerfile").read_text()
    prepared = _prepare(context, text, dict(build_args or {}), time.monotonic() + 120)
    return prepared.key, (root or build_dir()) / f"img-{prepared.key[:32]}"


def ensure_built(context: Path, dockerfile: Path | None = None, *, build_args: dict[str, str] | None = None,
                 timeout_s: float = 600, network: bool | None = None, root: Path | None = None) -> BuiltImage:
    """The image of ``dockerfile`` (default ``context/Dockerfile``) and ``context``, built now
    unless this directory has it already (see the module doc)."""
    started = time.monotonic()
    deadline = started + timeout_s
    context = Path(context).resolve()
    path = Path(dockerfile) if dockerfile else context / "Dockerfile"
    try:
        text = path.read_text()
    except OSError as exc:
        raise ImageBuildFailed(f"cannot read the Dockerfile {path}: {exc.strerror}") from None
    root = root or build_dir()
    _make_dir(root)
    prepared = _prepare(context, text, dict(build_args or {}), deadline)
    final = root / f"img-{prepared.key[:32]}"
    meta = final.with_suffix(".json")
    if not (meta.exists() and final.is_dir()):
        with locked(root / f"img-{prepared.key[:32]}.lock", deadline, f"{path}"):
            if not (meta.exists() and final.is_dir()):  # a concurrent caller may have built it meanwhile
                meta.unlink(missing_ok=True)
                _sweep(final)
                _build(prepared, context, final, _network(network), deadline, started)
    return BuiltImage.model_validate_json(meta.read_text())


def _sweep(final: Path) -> None:
    """What a killed build of this key left (its lock is ours now, so no build of it is live)."""
    for stale in final.parent.glob(f".{final.name}.*"):
        _remove(stale)
    if final.exists():  # a rootfs without its .json: a build cut short after the rename
        _remove(final)


def _remove(path: Path) -> None:
    try:
        remove_tree(path)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


def _build(prepared: _Prepared, context: Path, final: Path, network: str, deadline: float, started: float) -> None:
    root = final.parent
    who = sandbox.identity()
    scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    scratch.chmod(0o711)
    log_path = final.with_suffix(".log")
    try:
        ctx.snapshot(context, prepared.files, scratch / "context")
        sandbox.give(scratch / "context", who)
        with open(log_path, "wb") as log:
            build = steps.Build(scratch=scratch, context=scratch / "context", log_path=log_path, log=log,
                                deadline=deadline, network=network, who=who, build_dir=root,
                                base_of=prepared.base_of)
            try:
                for index in prepared.plan.needed:
                    stage = prepared.plan.stages[index]
                    steps.populate(stage, build)
                    for step in stage.steps:
                        steps.apply(stage, step, build)
            finally:
                for release in build.releases:
                    release()
        image = build.roots[prepared.plan.needed[-1]]
        finish.give_back(image, who.owner, build.chowns)
        finish.strip_special(image)
        shared = _debian_root(prepared, build)
        if shared is not None:
            finish.share_with_base(image, shared)
        built = _metadata(prepared, build, image, final, started)
        skipped = finish.mount_points(image)
        if skipped:
            built.notes.append(f"no mount point made where a link is in the way: {', '.join(skipped)}")
        text = built.model_dump_json(indent=1)
        fd = os.open(image, os.O_RDONLY | os.O_DIRECTORY)
        try:
            finish.write(fd, finish.METADATA, text)
        finally:
            os.close(fd)
        os.chmod(image, 0o755)
        os.rename(image, final)
        tmp = final.with_name(f".{final.name}.json.tmp")
        tmp.write_text(text)
        os.replace(tmp, final.with_suffix(".json"))
        global builds
        builds += 1
    finally:
        who.close()
        _remove(scratch)


def _debian_root(prepared: _Prepared, build: steps.Build) -> Path | None:
    """The Debian base the image descends from (through FROM <stage> too), if any."""
    stage = prepared.plan.target
    while stage.base_stage is not None:
        stage = prepared.plan.stages[stage.base_stage]
    base = prepared.base_of.get(stage.from_ref)
    if base is None or base.kind != "debian":
        return None
    return bases.ensure_debian(base, build.build_dir, build.deadline)


def _metadata(prepared: _Prepared, build: steps.Build, image: Path, final: Path, started: float) -> BuiltImage:
    target = prepared.plan.target
    first = prepared.plan.stages[prepared.plan.needed[0]]
    base = prepared.base_of.get(first.from_ref)
    based = [note for ref in prepared.plan.external_refs() for note in prepared.base_of[ref].notes]  # COPY --from's too
    notes = [*prepared.plan.notes, *(base.notes if base else []), *based, *target.notes, *build.notes]
    if target.user not in (None, "root", "0", "0:0"):
        notes.append(f"USER {target.user} recorded; sandboxes run as root")
    env = dict(target.env)
    env.setdefault("PATH", DEFAULT_PATH)
    return BuiltImage(rootfs=str(final), key=prepared.key, env=env, workdir=target.workdir, user=target.user,
                      from_ref=target.from_ref, base=base.description if base else first.from_ref,
                      notes=list(dict.fromkeys(notes)), log=str(build.log_path), config=target.config,
                      built_at=time.time(), build_s=round(time.monotonic() - started, 2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandboxes.runtimes.images.build",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("context", type=Path, help="The build context (its Dockerfile unless --dockerfile).")
    parser.add_argument("--dockerfile", type=Path)
    parser.add_argument("--build-arg", action="append", default=[], metavar="K=V")
    parser.add_argument("--timeout", type=float, default=None, help="Seconds (default: PRORL_IMAGE_BUILD_TIMEOUT_S).")
    parser.add_argument("--key", action="store_true", help="Print the key and the image directory; build nothing.")
    args = parser.parse_args(argv)
    build_args = dict(item.split("=", 1) if "=" in item else (item, os.environ.get(item, ""))
                      for item in args.build_arg)
    try:
        if args.key:
            key, where = image_key(args.context, args.dockerfile, build_args=build_args)
            print(key, where)
        else:
            built = ensure_built(args.context, args.dockerfile, build_args=build_args,
                                 timeout_s=args.timeout or _settings().image_build_timeout_s)
            print(built.rootfs)
            for note in built.notes:
                print(f"note: {note}", file=sys.stderr)
    except ProrlError as exc:
        print(f"{exc.type}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
