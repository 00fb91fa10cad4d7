"""The operator's sandbox policy: which runtimes, images, limits and repository sources a request
may ask for. Pure functions over settings, so the API, the workers and the sandbox host apply the
same rules (key decision 11: a request can only narrow the operator's policy, never widen it).

- runtimes: ``local`` (no isolation) only with ``allow_local_runtime``; a host serves only the
  runtimes it was started with, a dotted path being compared by the class it names.
- images: a path beneath one of ``sandbox_image_dirs`` after resolving symlinks (never ``/``,
  ``/etc`` or another host path), or a ``docker://`` reference to a registry the operator lists
  in ``sandbox_registries`` (an ``oci:`` layout beneath the image directories), parsed strictly
  by :mod:`sandboxes.images`; other transports (``docker-archive:``, ``library://``,
  ``oras://`` ...) are refused.
- limits: handler defaults merged field by field under the request, which may only lower them;
  operator ceilings (``sandbox_max_limits``) clamp both, and fill a limit nobody set.
- repository sources: https URLs, or directories beneath ``repo_source_dirs``.

``lexical=True`` checks are for the API, which may run on another node than the directories it
judges: they normalise ``..`` but do not resolve symlinks; the host and the worker resolve.
"""
from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import unquote, urlsplit

from pydantic import ValidationError

from prorl_celery.errors import InvalidRequest, PolicyDenied
from sandboxes import images
from sandboxes.base import Limits, SandboxSpec
from sandboxes.dirs import beneath as _beneath
from sandboxes.dirs import split_dirs
from sandboxes.registry import LOCAL, local_refused, names_local  # noqa: F401 - the same, here

# Why a network sandbox is refused where the operator turned them off (also the host's answer).
NETWORK_OFF = ("network sandboxes are turned off by the operator (PRORL_SANDBOX_NETWORK=off); "
               "ask without \"network\": true")
# Transports refused outright: docker-archive:/oci-archive:/docker-daemon: name host paths or the
# host's daemon, library://, oras://, shub:// and http(s):// reach registries outside the allow-list.
OTHER_SCHEMES = ("docker-archive:", "oci-archive:", "docker-daemon:", "library://", "oras://",
                 "shub://", "http://", "https://")
_CONTROL = re.compile(r"[\x00-\x20\x7f]")


def _settings():
    from config.settings import get_settings

    return get_settings()


# -- runtimes ---------------------------------------------------------------------------------
def local_allowed() -> bool:
    return bool(_settings().allow_local_runtime)


# -- images -----------------------------------------------------------------------------------
def check_image(image: str | None, field: str = "spec.image", lexical: bool = False) -> str | None:
    """The image to use (a bare name becomes its path beneath an image directory), or
    :class:`PolicyDenied` naming ``field``."""
    if image is None:
        return None
    if images.is_reference(image):  # docker:// and oci:: the registry allow-list (runtimes/images.py)
        return images.check_reference(image, field, lexical).canonical
    if image.startswith(OTHER_SCHEMES):
        raise PolicyDenied(f"sandbox image {image!r} refused: only docker:// and oci: references "
                           "(and image directories) are served; other transports reach hosts or "
                           "host paths the registry allow-list does not cover", field=field)
    if os.path.isabs(image) and not _CONTROL.search(image) and _beneath(image, _built_images(), lexical):
        return image if lexical else os.path.realpath(image)  # an image this node built itself
    roots = split_dirs(_settings().sandbox_image_dirs)
    if not roots:
        raise PolicyDenied(f"sandbox image {image!r} refused: no image directories are registered "
                           "(the operator lists them in PRORL_SANDBOX_IMAGE_DIRS)", field=field)
    if _CONTROL.search(image):
        raise PolicyDenied("sandbox image names may not contain spaces or control characters",
                           field=field)
    if not os.path.isabs(image):
        if image in ("", ".", "..") or "/" in image:
            raise PolicyDenied(f"sandbox image {image!r}: give an image name or an absolute path",
                               field=field)
        found = [os.path.join(root, image) for root in roots
                 if lexical or os.path.lexists(os.path.join(root, image))]
        if not found:
            raise PolicyDenied(f"no image {image!r} in {', '.join(roots)}", field=field)
        image = found[0]
    if not _beneath(image, roots, lexical):
        raise PolicyDenied(f"sandbox image {image!r} is not beneath a registered image directory "
                           f"({', '.join(roots)}), after resolving links", field=field)
    return image if lexical else os.path.realpath(image)


def _built_images() -> list[str]:
    """Where this node's images built by the service itself are (:func:`sandboxes.dirs.built_image_dirs`)."""
    from sandboxes.dirs import built_image_dirs

    return built_image_dirs()


# -- limits -----------------------------------------------------------------------------------
def _lower(a: Any, b: Any) -> Any:
    """The narrower of two limit values (None: unset)."""
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return min(a, b)
    return a  # not a number: the first (the operator's or the handler's) stands


def ceilings() -> dict[str, Any]:
    """The operator's ceilings, for fields ``Limits`` knows."""
    fields = Limits.model_fields
    return {name: value for name, value in (_settings().sandbox_max_limits or {}).items()
            if name in fields}


def _set_fields(limits: Limits | dict | None) -> dict[str, Any]:
    """Only the fields a caller actually gave (a Limits default is not a request)."""
    if limits is None:
        return {}
    if isinstance(limits, Limits):
        return limits.model_dump(exclude_unset=True)
    return Limits.model_validate(limits).model_dump(exclude_unset=True)


def _whole(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def cap_limits(limits: Limits, caps: dict[str, Any] | None = None) -> Limits:
    """Every field clamped to the operator's ceiling; an unset field gets the ceiling. The host
    applies this to every spec, so a direct host request cannot lift a ceiling either."""
    caps = ceilings() if caps is None else caps
    values = limits.model_dump()
    capped = {name: _whole(_lower(caps.get(name), values.get(name)) if values.get(name) is not None
                           else caps.get(name)) for name in Limits.model_fields}
    return Limits.model_validate(capped)


def merge_limits(defaults: Limits | dict | None, requested: Limits | dict | None,
                 caps: dict[str, Any] | None = None) -> Limits:
    """Field by field over ``Limits.model_fields``: the defaults are ``Limits``'s own overlaid by
    the handler's; a field the request gives may lower its default, never lift it, and null (or
    leaving it out) keeps the default; then the ceilings clamp (:func:`cap_limits`)."""
    base = {**Limits().model_dump(), **_set_fields(defaults)}
    asked = _set_fields(requested)
    merged = {name: _lower(base.get(name), asked.get(name)) if base.get(name) is not None
              else asked.get(name) for name in Limits.model_fields}
    return cap_limits(Limits.model_validate(merged), caps)


def clamp_spec(spec: SandboxSpec) -> SandboxSpec:
    """``spec`` with its limits under the operator's ceilings."""
    return spec.model_copy(update={"limits": cap_limits(spec.limits)})


def handler_spec(default_sandbox: dict[str, Any] | None, requested: dict[str, Any] | None) -> SandboxSpec:
    """A handler's sandbox spec for an instance: the instance's ``sandbox`` block over the
    handler's defaults, limits merged field by field (a request cannot lift them)."""
    default_sandbox = dict(default_sandbox or {})
    requested = dict(requested or {})
    spec = SandboxSpec.model_validate({**default_sandbox, **{k: v for k, v in requested.items()
                                                             if k != "limits"}})
    return spec.model_copy(update={"limits": merge_limits(default_sandbox.get("limits"),
                                                          requested.get("limits"))})


def check_request_network(block: Any, field: str = "instance.sandbox.network") -> None:
    """The API's part: a request for a network the operator turned off is refused at submit
    (whether a node has the tools for one is the sandbox host's to say)."""
    if isinstance(block, dict) and block.get("network") is True and _settings().sandbox_network == "off":
        raise PolicyDenied(NETWORK_OFF, field=field)


def check_request_sandbox(block: Any, field: str = "instance.sandbox") -> None:
    """What the API can tell about an instance's ``sandbox`` block before anything is stored."""
    if not isinstance(block, dict):
        return
    runtime = block.get("runtime")
    if isinstance(runtime, str) and names_local(runtime) and not local_allowed():
        raise local_refused(f"{field}.runtime")
    image = block.get("image")
    if isinstance(image, str):
        check_image(image, f"{field}.image", lexical=True)
    if "env" in block:  # LD_*, BASH_ENV, a planted PATH ...: SandboxSpec's own rules, named here
        try:
            SandboxSpec.model_validate({"env": block["env"]})
        except ValidationError as exc:
            raise InvalidRequest(f"{field}.env: {exc.errors()[0]['msg']}", field=f"{field}.env") from None
    check_request_network(block, f"{field}.network")
    if block.get("layers"):  # the service's own (a group's prepared root), never a request's to name
        raise PolicyDenied("sandbox layers are set by the service (tasks/harbor/fork.py), not by a request",
                           field=f"{field}.layers")


# -- repository sources -------------------------------------------------------------------------
def check_repo_source(source: str, field: str = "instance.repo_source",
                      lexical: bool = False) -> tuple[str, str]:
    """``("https", url)`` or ``("dir", path)`` (resolved unless ``lexical``); anything else, or a
    directory outside ``repo_source_dirs``, is :class:`PolicyDenied`."""
    if not isinstance(source, str) or not source or _CONTROL.search(source) or source.startswith("-"):
        raise PolicyDenied("repo_source must be an https URL or an allowed directory", field=field)
    if source.startswith("file://"):
        parts = urlsplit(source)
        if parts.netloc not in ("", "localhost"):
            raise PolicyDenied("a file:// repo_source must be on this machine", field=field)
        source = unquote(parts.path)
    elif "://" in source or "::" in source or not os.path.isabs(source):
        parts = urlsplit(source)
        if parts.scheme != "https" or not parts.hostname or parts.username or parts.password:
            raise PolicyDenied(f"repo_source {source!r} refused: only https URLs (without "
                               "credentials) or directories the operator lists in "
                               "PRORL_REPO_SOURCE_DIRS", field=field)
        return "https", source
    roots = split_dirs(_settings().repo_source_dirs)
    if not _beneath(source, roots, lexical):
        raise PolicyDenied(f"repo_source directory {source!r} is not beneath a directory the "
                           f"operator allows (PRORL_REPO_SOURCE_DIRS: {', '.join(roots) or 'none'}), "
                           "after resolving links", field=field)
    return "dir", source if lexical else os.path.realpath(source)
