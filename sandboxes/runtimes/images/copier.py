"""COPY and ADD, run INSIDE the build sandbox by the node's own Python (standard library only).

The builder binds the sources read-only under ``/dev/prorl`` and runs this file with the image
being built as ``/``: every destination path, and every link an earlier RUN left in the image,
resolves inside the image, never on the host. Argument: the path of a JSON spec::

    {"sources": ["/dev/prorl/ctx/a*", "https://..."], "inline": {"name": "content"}, "dest": "/app/",
     "add": false, "chmod": "644" | null, "chown": "user:group" | null, "checksum": null}
    {"mkdir": "/app"}

Sources are globs (``*``, ``?``, ``[...]``) under the bound context or stage root; URLs (ADD only)
are downloaded here, inside the build's own network, and checked against ``--checksum``.

Docker's rules: a source directory's contents (not the directory) are copied; the destination is
a directory when it ends in ``/``, when there are several sources, or when it already is one; ADD
unpacks a local tar archive (plain, gzip, bzip2, xz) into the destination directory. Prints a
JSON object: the top-level paths written and the uid/gid ``--chown`` names in this image.
"""
import glob
import hashlib
import json
import os
import shutil
import stat
import sys
import tarfile
import urllib.parse
import urllib.request


def _ids(spec: str | None) -> tuple[int, int] | None:
    if not spec:
        return None
    user, _, group = spec.partition(":")
    uid = _lookup("/etc/passwd", user)
    gid = _lookup("/etc/group", group) if group else _primary_gid(user, uid)
    return uid, gid


def _lookup(table: str, name: str) -> int:
    if name.isdigit():
        return int(name)
    try:
        with open(table) as fh:
            for line in fh:
                fields = line.split(":")
                if fields[0] == name and len(fields) > 2:
                    return int(fields[2])
    except OSError:
        pass
    raise SystemExit(f"--chown: no {name!r} in the image's {table}")


def _primary_gid(user: str, uid: int) -> int:
    try:
        with open("/etc/passwd") as fh:
            for line in fh:
                fields = line.split(":")
                if len(fields) > 3 and (fields[0] == user or fields[2] == str(uid)):
                    return int(fields[3])
    except OSError:
        pass
    return uid


def _copy_one(src: str, target: str) -> None:
    st = os.lstat(src)
    if stat.S_ISDIR(st.st_mode):
        os.makedirs(target, exist_ok=True)
        for name in sorted(os.listdir(src)):
            _copy_one(os.path.join(src, name), os.path.join(target, name))
        shutil.copystat(src, target, follow_symlinks=False)
        return
    if os.path.lexists(target) and not os.path.isdir(target):
        os.unlink(target)
    elif os.path.isdir(target) and not os.path.islink(target):
        shutil.rmtree(target)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), target)
    else:
        shutil.copy2(src, target)


def _is_archive(path: str) -> bool:
    try:
        return os.path.isfile(path) and tarfile.is_tarfile(path)
    except OSError:
        return False


def _extract(path: str, into: str) -> None:
    with tarfile.open(path) as tar:
        members = [m for m in tar.getmembers() if not (m.isdev() or m.isfifo())]
        tar.extractall(into, members=members, numeric_owner=True)  # inside the image: links stay in it


def _expand(patterns: list[str]) -> list[str]:
    out = []
    for pattern in patterns:
        if pattern.startswith(("http://", "https://")):
            out.append(pattern)
            continue
        found = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else \
            ([pattern] if os.path.lexists(pattern) else [])
        if not found:
            shown = pattern.split("/", 4)[-1] if pattern.startswith("/dev/prorl/") else pattern
            raise SystemExit(f"source {shown!r} not found (in the build context, minus .dockerignore, "
                             "or the --from stage)")
        out += found
    return out


def _download(url: str, dest: str, as_dir: bool, checksum: str | None) -> str:
    name = os.path.basename(urllib.parse.urlparse(url).path) or "index.html"
    target = os.path.join(dest, name) if as_dir else dest
    h = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=120) as response, open(target, "wb") as out:
        for chunk in iter(lambda: response.read(1 << 20), b""):
            h.update(chunk)
            out.write(chunk)
    if checksum and checksum != f"sha256:{h.hexdigest()}":
        raise SystemExit(f"ADD {url}: checksum sha256:{h.hexdigest()} is not {checksum}")
    os.chmod(target, 0o600)
    return target


def main(spec_path: str) -> None:
    with open(spec_path) as fh:
        spec = json.load(fh)
    if "mkdir" in spec:
        os.makedirs(spec["mkdir"], exist_ok=True)
        return
    sources, inline, dest = _expand(spec["sources"]), spec["inline"], spec["dest"]
    count = len(sources) + len(inline)
    as_dir = dest.endswith("/") or count > 1 or os.path.isdir(dest)
    written = []
    if as_dir:
        os.makedirs(dest, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dest) or "/", exist_ok=True)
    for src in sources:
        if src.startswith(("http://", "https://")):
            written.append(_download(src, dest, as_dir, spec.get("checksum")))
            continue
        if spec["add"] and spec.get("unpack", True) and _is_archive(src):
            _extract(src, dest if as_dir else os.path.dirname(dest))
            written.append(dest if as_dir else os.path.dirname(dest))
            continue
        if os.path.isdir(src) and not os.path.islink(src):
            os.makedirs(dest, exist_ok=True)
            for name in sorted(os.listdir(src)):
                _copy_one(os.path.join(src, name), os.path.join(dest, name))
                written.append(os.path.join(dest, name))
            continue
        target = os.path.join(dest, os.path.basename(src)) if as_dir else dest
        _copy_one(src, target)
        written.append(target)
    for name, content in inline.items():
        target = os.path.join(dest, name) if as_dir else dest
        with open(target, "w") as fh:
            fh.write(content)
        written.append(target)
    if spec.get("chmod"):
        mode = int(spec["chmod"], 8)
        for path in written:
            for current in _tree(path):
                os.chmod(current, mode)
    ids = _ids(spec.get("chown"))
    print(json.dumps({"written": written, "uid": ids[0] if ids else None, "gid": ids[1] if ids else None}))


def _tree(path: str):
    if os.path.islink(path):
        return
    yield path
    if os.path.isdir(path):
        for current, dirs, files in os.walk(path):
            for name in dirs + files:
                full = os.path.join(current, name)
                if not os.path.islink(full):
                    yield full


if __name__ == "__main__":
    main(sys.argv[1])
