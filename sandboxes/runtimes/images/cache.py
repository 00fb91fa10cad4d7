"""The sandbox host's image cache: one read-only rootfs per manifest digest, under a size budget.

::

    <cache>/images/<hex>/rootfs        the unpacked image (what bwrap binds read-only)
    <cache>/images/<hex>/meta.json     digest, size, the image's env and workdir
    <cache>/images/<hex>.lock          flock: shared while a sandbox uses the image, exclusive to
                                       evict it; its mtime is the last use (LRU)
    <cache>/refs/<sha256 of ref>.json  a tag's digest when last resolved
    <cache>/locks/<hex>.pull           flock held by the one process pulling that digest
    <cache>/tools/                     skopeo's own configuration, HOME and TMPDIR

The locks are ``flock``s, so several sandbox hosts of a node can share one cache and a killed
host holds nothing. Creates of the same image in one host wait for one pull (an in-flight map);
in other hosts they wait on the pull lock, then find the image. Every wait and every tool call
ends at the pull deadline. Eviction runs after each pull, oldest use first, and skips every image
whose lock someone holds shared, i.e. every image a live sandbox runs in.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import secrets
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from prorl_celery.errors import ImageTooLarge, ImageUnavailable
from sandboxes.runtimes.images.lease import FileLock, ImageLease
from sandboxes.runtimes.images.pull import Tools, image_config, layer_bytes, sanitize
from sandboxes.images import ImageRef
from sandboxes.safedirs import private_dir, remove_tree

log = logging.getLogger(__name__)
_MB = 1 << 20


def _hex(digest: str) -> str:
    return digest.split(":", 1)[1]


class ImageCache:
    """Images by digest under ``root``; ``budget_mb`` of unpacked bytes at most."""

    def __init__(self, root: str | os.PathLike, budget_mb: int, pull_timeout_s: float,
                 refresh_s: float):
        self.root = private_dir(root, 0o711)
        for name in ("images", "refs", "locks"):
            private_dir(self.root / name, 0o711 if name == "images" else 0o700)
        self.tools = Tools(self.root / "tools")
        self.budget = budget_mb * _MB
        self.pull_timeout_s = pull_timeout_s
        self.refresh_s = refresh_s
        self.pulls = 0  # pulls this process made (the cache's own account, for tests and /health)
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._sweep_stale()

    # -- public -----------------------------------------------------------------------------
    def acquire(self, ref: ImageRef) -> ImageLease:
        """A lease on ``ref``'s rootfs: from the cache, else pulled (once for concurrent callers)."""
        started = time.monotonic()
        deadline = started + self.pull_timeout_s
        digest, manifest = self.resolve(ref, deadline)
        lease = self._lease(ref, digest, pulled=False, started=started)
        if lease is not None:
            return lease
        self._shared_pull(ref, digest, manifest, deadline)
        lease = self._lease(ref, digest, pulled=True, started=started)
        if lease is None:  # evicted between the pull and now: only under a budget below one image
            raise ImageUnavailable(f"image {ref.canonical!r} was evicted as soon as it was pulled; "
                                   "raise PRORL_SANDBOX_IMAGE_CACHE_MB", field="spec.image")
        return lease

    def resolve(self, ref: ImageRef, deadline: float) -> tuple[str, dict | None]:
        """(digest, manifest or None when not fetched) that ``ref`` names."""
        if ref.digest:
            return ref.digest, None
        known = self._known(ref)
        if known and time.time() - known["resolved_at"] < self.refresh_s:
            return known["digest"], None
        try:
            digest, manifest = self.tools.manifest(ref, deadline)
        except ImageUnavailable:
            if known is None:
                raise
            log.warning("registry of %s did not answer; using its last known digest %s",
                        ref.canonical, known["digest"])
            return known["digest"], None
        self._write_json(self._ref_path(ref), {"ref": ref.canonical, "digest": digest,
                                               "resolved_at": time.time()})
        return digest, manifest

    def images(self) -> list[dict]:
        """meta.json of every cached image, with ``last_used`` (epoch seconds)."""
        out = []
        for meta_path in (self.root / "images").glob("*/meta.json"):
            try:
                meta = json.loads(meta_path.read_text())
                meta["last_used"] = os.stat(self._lock_path(meta["digest"])).st_mtime
            except (OSError, ValueError, KeyError):
                continue
            out.append(meta)
        return sorted(out, key=lambda meta: meta["last_used"])

    def evict(self, keep: str | None = None) -> list[str]:
        """Oldest-used images removed until the cache fits its budget; in-use ones are skipped."""
        with self._exclusive(self.root / "locks" / "index"):
            entries = self.images()
            total = sum(meta["size"] for meta in entries)
            evicted = []
            for meta in entries:
                if total <= self.budget:
                    break
                if meta["digest"] != keep and self._remove_unused(meta["digest"]):
                    total -= meta["size"]
                    evicted.append(meta["digest"])
        for digest in evicted:
            log.info("image cache: evicted %s", digest)
        return evicted

    # -- leases ----------------------------------------------------------------------------
    def _image_dir(self, digest: str) -> Path:
        return self.root / "images" / _hex(digest)

    def _lock_path(self, digest: str) -> Path:
        return self.root / "images" / f"{_hex(digest)}.lock"

    def _lease(self, ref: ImageRef, digest: str, pulled: bool, started: float) -> ImageLease | None:
        fd = os.open(self._lock_path(digest), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only for an eviction in progress
        try:
            meta = json.loads((self._image_dir(digest) / "meta.json").read_text())
        except (OSError, ValueError):
            os.close(fd)
            return None
        os.utime(fd)
        return ImageLease(ref.canonical, digest, str(self._image_dir(digest) / "rootfs"),
                          meta.get("env") or {}, meta.get("workdir"), pulled,
                          time.monotonic() - started, fd)

    def _remove_unused(self, digest: str) -> bool:
        fd = os.open(self._lock_path(digest), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # a live sandbox runs in it
            doomed = self.root / "images" / f".evicted-{_hex(digest)}-{secrets.token_hex(4)}"
            os.rename(self._image_dir(digest), doomed)  # gone for new leases at once
            remove_tree(doomed)
            return True
        except FileNotFoundError:
            return False
        finally:
            os.close(fd)

    # -- pulls -----------------------------------------------------------------------------
    def _shared_pull(self, ref: ImageRef, digest: str, manifest: dict | None, deadline: float) -> None:
        with self._lock:
            future = self._inflight.get(digest)
            mine = future is None
            if mine:
                future = self._inflight[digest] = Future()
        if not mine:
            try:
                return future.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise ImageUnavailable(f"waited for a concurrent pull of {ref.canonical!r} past "
                                       "PRORL_SANDBOX_IMAGE_PULL_TIMEOUT_S", field="spec.image") from None
        try:
            with self._exclusive(self.root / "locks" / f"{_hex(digest)}.pull", deadline, ref):
                if not (self._image_dir(digest) / "meta.json").exists():  # another host pulled it
                    self._pull(ref, digest, manifest, deadline)
            future.set_result(None)
        except BaseException as exc:
            future.set_exception(exc)
            raise
        finally:
            with self._lock:
                self._inflight.pop(digest, None)

    def _pull(self, ref: ImageRef, digest: str, manifest: dict | None, deadline: float) -> None:
        compressed = layer_bytes(manifest) if manifest else None
        if compressed is not None and compressed > self.budget:
            raise ImageTooLarge(f"image {ref.canonical!r} has {compressed // _MB} MiB of layers, "
                                f"over the image cache budget ({self.budget // _MB} MiB, "
                                "PRORL_SANDBOX_IMAGE_CACHE_MB)", field="spec.image")
        work = self.root / "images" / f".pull-{_hex(digest)}-{secrets.token_hex(4)}"
        work.mkdir(mode=0o700)
        if self._image_dir(digest).exists():  # a rootfs without meta.json: a remove cut short
            remove_tree(self._image_dir(digest))
        try:
            self.tools.copy(ref, digest, work / "layout", deadline)
            (work / "bundle").mkdir(mode=0o700)
            self.tools.unpack(ref, work / "layout", work / "bundle" / "rootfs", deadline)
            config = image_config(work / "layout")
            remove_tree(work / "layout")
            size = sanitize(work / "bundle" / "rootfs")
            if size > self.budget:
                raise ImageTooLarge(f"image {ref.canonical!r} unpacks to {size // _MB} MiB, over "
                                    f"the image cache budget ({self.budget // _MB} MiB, "
                                    "PRORL_SANDBOX_IMAGE_CACHE_MB)", field="spec.image")
            meta = {"digest": digest, "ref": ref.canonical, "size": size, "pulled_at": time.time(),
                    **config}
            self._write_json(work / "bundle" / "meta.json", meta)
            os.chmod(work / "bundle", 0o711)
            os.rename(work / "bundle", self._image_dir(digest))
            os.close(os.open(self._lock_path(digest), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
            os.utime(self._lock_path(digest))
            self.pulls += 1
        finally:
            remove_tree(work)
        log.info("image cache: pulled %s (%s, %d MiB)", ref.canonical, digest, size // _MB)
        self.evict(keep=digest)

    # -- small helpers ---------------------------------------------------------------------
    def _sweep_stale(self) -> None:
        """Remove what killed pulls and evictions left (a pull still running keeps its lock)."""
        for path in (self.root / "images").glob(".*-*"):
            kind, _, rest = path.name[1:].partition("-")
            if kind == "pull":
                try:
                    with self._exclusive(self.root / "locks" / f"{rest.split('-')[0]}.pull", time.monotonic()):
                        remove_tree(path)
                except ImageUnavailable:
                    continue  # in progress in another host
            elif kind == "evicted":
                try:
                    remove_tree(path)
                except OSError:
                    pass

    def _ref_path(self, ref: ImageRef) -> Path:
        return self.root / "refs" / f"{hashlib.sha256(ref.canonical.encode()).hexdigest()}.json"

    def _known(self, ref: ImageRef) -> dict | None:
        try:
            known = json.loads(self._ref_path(ref).read_text())
            return known if isinstance(known.get("resolved_at"), (int, float)) else None
        except (OSError, ValueError, AttributeError):
            return None

    @staticmethod
    def _write_json(path: Path, value: dict) -> None:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)

    def _exclusive(self, path: Path, deadline: float | None = None, ref: ImageRef | None = None):
        return FileLock(path, deadline, ref)


@functools.cache
def default_cache() -> ImageCache:
    """This process's cache, from settings (``sandbox_image_cache`` ...)."""
    import tempfile

    from config.settings import get_settings

    settings = get_settings()
    root = settings.sandbox_image_cache or os.path.join(tempfile.gettempdir(), "prorl-images")
    return ImageCache(root, settings.sandbox_image_cache_mb, settings.sandbox_image_pull_timeout_s,
                      settings.sandbox_image_refresh_s)


def open_image(image: str) -> ImageLease:
    """A lease on a (policy-checked, canonical) ``docker://``/``oci:`` image for a sandbox."""
    from sandboxes.images import check_reference

    return default_cache().acquire(check_reference(image))
