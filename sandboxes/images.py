"""Container image references (``docker://``, ``oci:``) and the operator's registry allow-list.

Pure functions over settings, so the API, the worker and the sandbox host judge a reference the
same way; the host then pulls it (:mod:`sandboxes.runtimes.images.cache`). Any runtime that takes
``docker://`` (bwrap here, ``apptainer pull`` for singularity) calls :func:`check_reference`.

- ``docker://[registry/]repository[:tag][@sha256:<hex>]``, in the grammar of the distribution
  reference (lower-case path components joined by ``/``; a tag of at most 128 word characters,
  ``.`` and ``-``; a digest of 64 hex digits). No ``..``, no leading ``-``, no spaces or control
  characters, at most 255 characters: the parts are passed to skopeo as one argument after a
  fixed transport prefix, never as options. Without a registry (``python:3.11``), Docker Hub
  (``docker.io``, ``library/`` for one-component names) is meant, as Docker does.
- The registry must be listed in ``sandbox_registries`` (``PRORL_SANDBOX_REGISTRIES``, comma
  separated; empty: no registry at all). An entry is ``host[:port]`` (exact, port included) or
  ``host[:port]/path`` (that repository and those beneath it). Registries reached over plain HTTP
  or without verifying TLS are only those also in ``sandbox_insecure_registries``.
- ``oci:<path>[:<tag>]`` names an OCI image layout on the sandbox host; the path must lie beneath
  ``sandbox_image_dirs`` like a rootfs directory (after resolving links, except ``lexical``).
"""
from __future__ import annotations

import os
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict

from prorl_celery.errors import InvalidRequest, PolicyDenied
from sandboxes.dirs import beneath, split_dirs

DOCKER, OCI = "docker://", "oci:"
SCHEMES = (DOCKER, OCI)
DOCKER_HUB = "docker.io"
_HUB_ALIASES = {"docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com"}
_DOMAIN = re.compile(r"^(?:[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)*"
                     r"(?::[0-9]{1,5})?$")
_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_CONTROL = re.compile(r"[\x00-\x20\x7f]")
MAX_REFERENCE = 255


class ImageRef(BaseModel):
    """A parsed, normalised image reference."""

    model_config = ConfigDict(frozen=True)

    transport: Literal["docker", "oci"]
    registry: str = ""  # host[:port], lower case; "" for oci
    repository: str = ""  # docker: path in the registry; oci: the layout's directory
    tag: str | None = None
    digest: str | None = None

    @property
    def canonical(self) -> str:
        """The reference as the service passes it on (registry spelled out, default tag)."""
        if self.transport == "oci":
            return f"{OCI}{self.repository}:{self.tag or 'latest'}"
        name = f"{DOCKER}{self.registry}/{self.repository}"
        if self.digest:
            return f"{name}@{self.digest}" if not self.tag else f"{name}:{self.tag}@{self.digest}"
        return f"{name}:{self.tag or 'latest'}"

    def skopeo(self, digest: str | None = None) -> str:
        """skopeo's source argument; with ``digest``, pinned to exactly that manifest."""
        if self.transport == "oci":
            return f"oci:{self.repository}:{self.tag or 'latest'}"
        pinned = digest or self.digest
        base = f"docker://{self.registry}/{self.repository}"
        return f"{base}@{pinned}" if pinned else f"{base}:{self.tag or 'latest'}"


def is_reference(image: str | None) -> bool:
    """Whether ``image`` is a registry or OCI-layout reference (not a rootfs directory)."""
    return isinstance(image, str) and image.startswith(SCHEMES)


def _settings():
    from config.settings import get_settings

    return get_settings()


def _bad(image: str, why: str, field: str) -> InvalidRequest:
    return InvalidRequest(f"image reference {image[:300]!r} refused: {why}", field=field)


def _split_name(rest: str) -> tuple[str, str | None, str | None]:
    """``name[:tag][@digest]`` -> (name, tag, digest); the tag's ``:`` is after the last ``/``."""
    name, _, digest = rest.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = None
    if colon > slash:
        name, tag = name[:colon], name[colon + 1:]
    return name, tag, digest or None


def _registry_of(name: str) -> tuple[str, str]:
    first, _, remainder = name.partition("/")
    if remainder and ("." in first or ":" in first or first == "localhost"):
        registry = first.lower()
        return (DOCKER_HUB if registry in _HUB_ALIASES else registry), remainder
    return DOCKER_HUB, name


def parse_docker(image: str, field: str = "spec.image") -> ImageRef:
    """A ``docker://`` reference, validated and normalised; :class:`InvalidRequest` otherwise."""
    rest = image[len(DOCKER):]
    if len(image) > MAX_REFERENCE or _CONTROL.search(image):
        raise _bad(image, f"over {MAX_REFERENCE} characters, or spaces/control characters", field)
    name, tag, digest = _split_name(rest)
    registry, repository = _registry_of(name)
    if not _DOMAIN.match(registry):
        raise _bad(image, f"registry {registry!r} is not a host name[:port]", field)
    parts = repository.split("/")
    if not all(_COMPONENT.match(part) for part in parts):
        raise _bad(image, "repository path components are lower-case letters and digits joined "
                          "by '.', '_', '__' or '-' (no '..', no leading '-', no empty parts)", field)
    if registry == DOCKER_HUB and len(parts) == 1:
        repository = f"library/{repository}"
    if tag is not None and not _TAG.match(tag):
        raise _bad(image, "a tag is 1-128 letters, digits, '_', '.', '-', not starting with '.' or '-'", field)
    if digest is not None and not _DIGEST.match(digest):
        raise _bad(image, "a digest is sha256: followed by 64 lower-case hex digits", field)
    return ImageRef(transport="docker", registry=registry, repository=repository, tag=tag, digest=digest)


def parse_oci(image: str, field: str = "spec.image", lexical: bool = False) -> ImageRef:
    """An ``oci:<layout dir>[:<tag>]`` reference to a layout beneath an image directory."""
    rest = image[len(OCI):]
    if len(image) > 4096 or _CONTROL.search(image):
        raise _bad(image, "too long, or spaces/control characters", field)
    path, _, tag = rest.partition(":")
    if ":" in tag or not os.path.isabs(path):
        raise _bad(image, "give oci:<absolute layout directory>[:<tag>] (no ':' in the path)", field)
    if tag and not _TAG.match(tag):
        raise _bad(image, "a tag is 1-128 letters, digits, '_', '.', '-'", field)
    roots = split_dirs(_settings().sandbox_image_dirs)
    if not beneath(path, roots, lexical):
        raise PolicyDenied(f"OCI layout {path!r} is not beneath a registered image directory "
                           f"(PRORL_SANDBOX_IMAGE_DIRS: {', '.join(roots) or 'none'}), after "
                           "resolving links", field=field)
    resolved = os.path.normpath(path) if lexical else os.path.realpath(path)
    return ImageRef(transport="oci", repository=resolved, tag=tag or None)


def _entries(value: str) -> list[str]:
    out = []
    for entry in (value or "").split(","):
        entry = entry.strip().lower().removeprefix("docker://").rstrip("/")
        if entry:
            host, _, path = entry.partition("/")
            out.append(f"{DOCKER_HUB if host in _HUB_ALIASES else host}{'/' + path if path else ''}")
    return out


def _listed(ref: ImageRef, entries: list[str]) -> bool:
    name = f"{ref.registry}/{ref.repository}"
    return any(name.startswith(entry + "/") if "/" in entry else ref.registry == entry
               for entry in entries)


def registry_allowed(ref: ImageRef) -> bool:
    """Whether the operator lists the reference's registry (or a path above its repository)."""
    return ref.transport == "oci" or _listed(ref, _entries(_settings().sandbox_registries))


def insecure(ref: ImageRef) -> bool:
    """Whether the registry is reached over plain HTTP / unverified TLS (operator's choice)."""
    return ref.transport == "docker" and _listed(ref, _entries(_settings().sandbox_insecure_registries))


def check_reference(image: str, field: str = "spec.image", lexical: bool = False) -> ImageRef:
    """The parsed reference if the operator's policy allows pulling it; else
    :class:`InvalidRequest` (malformed) or :class:`PolicyDenied` (registry not listed), naming
    ``field``."""
    if image.startswith(OCI):
        return parse_oci(image, field, lexical)
    if not image.startswith(DOCKER):
        raise _bad(image, f"not a {' or '.join(SCHEMES)} reference", field)
    ref = parse_docker(image, field)
    if not registry_allowed(ref):
        listed = ", ".join(_entries(_settings().sandbox_registries)) or "none"
        raise PolicyDenied(f"image {ref.canonical!r} refused: registry {ref.registry!r} is not "
                           f"one the operator allows (PRORL_SANDBOX_REGISTRIES: {listed})", field=field)
    return ref
