"""Whose request this is, and what it may see: the operator's token sees everything; a project key
(``prorl_celery.projects``) sees only what its project made. Another project's job, group or
private backend is answered exactly as an unknown id is (404, the same body), never 403: the
answer must not tell that it exists."""
from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit
from typing import TypeVar

from flask import g

from config.settings import get_settings

from prorl_celery import keys
from prorl_celery.errors import PolicyDenied, UnknownBackend, UnknownJob
from prorl_celery.jobs import JobRecord, JobStore
from prorl_celery.llm.models import Backend
from prorl_celery.llm.registry import BackendRegistry

T = TypeVar("T", JobRecord, Backend)


def caller() -> str | None:
    """The calling project; None for the operator. Fails closed: a request the token check did
    not pass (an open path) is nobody's, never the operator's."""
    if not g.get("authenticated"):
        raise RuntimeError("caller() on a request that was not authenticated")
    return g.get("project")


def sees(owner: str | None) -> bool:
    """Whether the caller may see a thing of ``owner`` (None or '': the operator's)."""
    project = caller()
    return project is None or (owner or None) == project


def own(items: Iterable[T | None]) -> list[T]:
    """The caller's jobs (records) of ``items``, Nones dropped."""
    return [item for item in items if item is not None and sees(item.project)]


def owned_record(store: JobStore, job_id: str) -> JobRecord:
    """The job's record if the caller may see it; else UnknownJob as for an id never used."""
    record = store.get(job_id)
    if record is None or not sees(record.project):
        raise UnknownJob(job_id)
    return record


def check_job(store: JobStore, job_id: str) -> None:
    """UnknownJob unless the job exists and the caller may see it (one HMGET, not the record)."""
    exists, owner = store.redis.hmget(keys.job(job_id), ["status", "project"])
    if exists is None or not sees(owner.decode() if owner else None):
        raise UnknownJob(job_id)


def backend_visible(backend: Backend) -> bool:
    """Shared backends (the operator's) are everyone's to see and use; a private one its project's."""
    return caller() is None or backend.project in (None, caller())


def visible_backend(backend: Backend) -> Backend:
    if not backend_visible(backend):
        raise UnknownBackend(backend.id)
    return backend


def check_backend_control(backend: Backend) -> None:
    """Removing, draining, pausing and resuming: the operator any backend, a project its own.
    A shared backend is visible to the project, so refusing it says nothing new: 403."""
    visible_backend(backend)
    if caller() is not None and backend.project != caller():
        raise PolicyDenied(f"backend {backend.id} is shared: only the operator's token may change it", field="ids")


def controlled_ids(registry: BackendRegistry, ids: list[str] | None) -> list[str] | None:
    """The backends a drain, pause or resume acts on: for the operator ``ids`` as given (None:
    all); for a project its own private ones (None: all of them), each id checked as
    :func:`check_backend_control` does."""
    if caller() is None:
        return ids
    if ids is None:
        return [b.id for b in registry.list() if b.project == caller()]
    found = {b.id: b for b in registry.get_many(ids)}
    for bid in ids:
        if bid not in found:
            raise UnknownBackend(bid)
        check_backend_control(found[bid])
    return list(ids)


def ids_by_owner(store: JobStore, job_ids: list[str]) -> dict[str | None, list[str]]:
    """Those of ``job_ids`` the caller may see, by the project that owns each (None: the
    operator's, and ids of no job for the operator); another project's act as unknown ids."""
    pipe = store.redis.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.hget(keys.job(job_id), "project")
    out: dict[str | None, list[str]] = {}
    for job_id, owner in zip(job_ids, pipe.execute()):
        owner = owner.decode() if owner else None
        if caller() is None or (owner is not None and owner == caller()):
            out.setdefault(owner, []).append(job_id)
    return out


def operator_only(what: str) -> None:
    """A route that shows the whole fleet: the operator's token only."""
    if caller() is not None:
        raise PolicyDenied(f"{what} shows the whole fleet: only the operator's token may read it")


def check_backend_address(address: str) -> None:
    """A project registers a backend only at an address inside the operator's
    ``project_backend_networks`` (the API would probe, and the workers call, whatever it names:
    loopback services, a metadata endpoint). The operator's token is not checked."""
    if caller() is None:
        return
    allowed = [n.strip() for n in get_settings().project_backend_networks.split(",") if n.strip()]
    if "*" in allowed:
        return
    host = urlsplit(address).hostname or ""
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None)} if allowed else set()
    except OSError:
        found = set()
    networks = [ipaddress.ip_network(n, strict=False) for n in allowed]
    if not found or not all(any(ipaddress.ip_address(a.split("%")[0]) in n for n in networks) for a in found):
        raise PolicyDenied(f"address: {host!r} is outside the networks a project may register backends in "
                           f"(PRORL_PROJECT_BACKEND_NETWORKS: {', '.join(allowed) or 'none'})", field="address")
