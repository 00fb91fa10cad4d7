"""Exceptions raised inside the service, and how they cross every wire.

Task-level outcomes (a command exits 1, a test fails, a wrong answer) are data in the result, not
exceptions. What follows is for infrastructure faults and bad input; each class carries its wire
``type`` and its HTTP ``http_status``::

    ProrlError                                     error 500
    ├── InvalidRequest(ValueError)                 invalid_request 400  bad input; carries the field
    │   ├── PolicyDenied                           policy_denied 403    beyond the operator's policy
    │   ├── JobIdConflict                          job_id_conflict 409  a known job id, another request
    │   ├── TaskQuarantined                        task_quarantined 409  the hack audit found the task hackable
    │   ├── QuotaExceeded                          quota_exceeded 413   past a byte quota of the rollout store
    │   └── ImageError                             image_error 400      a sandbox image could not be had
    │       ├── ImageNotFound                      image_not_found 404  no such image, tag or digest
    │       ├── ImageUnavailable                   image_unavailable 424  registry down, pull timed out
    │       └── ImageTooLarge                      image_too_large 413  beyond the host's image cache
    ├── NotFound(KeyError)                         not_found 404        no such id
    │   └── UnknownJob, UnknownGroup, UnknownBackend, UnknownProject
    ├── JobAlreadyTerminal                         conflict 409         the job ended before the operation
    ├── JobCancelled                               cancelled            raised in a stage of a cancelled job
    ├── StageBudgetExceeded(TimeoutError)          timeout 504          a stage ran past its time budget
    ├── UnknownPlugin(LookupError)                 unknown_plugin 400   a handler or runtime not registered
    ├── FileError(OSError)                         file_error 400       a file operation in a sandbox failed
    │   ├── FileMissing(FileNotFoundError)         file_not_found 404
    │   └── FileDenied(PermissionError)            permission_denied 403  e.g. a path out of the workspace
    ├── SandboxError                               sandbox              a sandbox or sandbox host failed
    │   ├── NoSandboxCapacity                      no_sandbox_capacity 503  every live host is full
    │   ├── SandboxGone                            sandbox_gone 404     lease lapsed, host died
    │   ├── FileTooLarge(OSError)                  file_too_large 413   a read over the host's cap
    │   ├── EnvBuildFailed                         env_build_failed     an environment could not be built
    │   └── UnsafeDirectory                        unsafe_directory     a host directory not safely its own
    ├── ImageBuildFailed                           image_build_failed 500  a Dockerfile could not be built
    ├── SidecarFailed                              sidecar_failed       a task's sidecar service never got ready
    ├── VerifierFailed                             verifier_failed      a task's verifier could not grade
    │   └── VerifierTimedOut, VerifierNoReward     verifier_timeout, verifier_no_reward
    ├── TooManyStreams                             too_many_requests 429  streams and long polls over the cap
    │   ├── RateLimited                            a gateway session's operations past its rate or concurrency
    │   └── OverQuota                              over_quota 429       a project at a quota whose over is 429
    ├── StoreUnavailable                           store_unavailable 503  the job store is down
    ├── StoreLayoutMismatch                        store_layout_mismatch 500  PRORL_STORE_SHARDS differs from the store's
    ├── RolloutFailed                              rollout_failed       no trajectory a trainer can train on
    └── LLMError                                   llm                  a backend or the LLM pool failed
        ├── BackendFailed                          one call failed (connection, 5xx, timeout); retried
        │   ├── LogprobMismatch                    the answer's logprobs do not match its tokens
        │   └── BackendAborted                     aborted by the server (weight update): no quarantine
        │       └── PartialAborted                 ... with the tokens so far: the turn continues from them
        ├── BackendUnavailable                     retry budget spent, or no backend came up in time
        ├── ContextWindowExceeded                  the conversation no longer fits the context
        ├── LLMTimeout(TimeoutError)               the caller's own (shortened) call timeout passed
        ├── LLMRequestRejected                     the server refused the request (4xx); not retried
        ├── LLMCallCancelled(JobCancelled)         cancelled  the caller's should_stop() fired
        └── BudgetSpent                            (llm)      a gateway session's budget is spent

A class defining a ``type`` registers it (:func:`error_class`); a subclass may share its parent's
type (and then its status). One type has one status on every server (the API, the sandbox host,
the LLM pool): a server answers ``{"error": exc.to_dict()}`` with ``exc.http_status``
(:class:`ErrorBody`, :func:`error_body` for an answer that is no class of ours: a framework's
404, a missing token); a client raises :func:`from_wire` of that body: the same class, or its
fallback for a type it does not know. Every class on the wire is defined here, so that any
process (the API, a host, a worker, a trainer's client) knows every type without importing the
module that raises it.
"""
from __future__ import annotations

import errno
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

_REGISTRY: dict[str, type[ProrlError]] = {}


class ProrlError(Exception):
    """Root of every exception the service raises on purpose."""

    type: str = "error"
    http_status: int = 500
    field: str | None = None
    remote: bool = False  # rebuilt from a server's answer (from_wire)
    remote_type: str | None = None  # the server's type, when this side did not know it

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "type" in cls.__dict__:
            _register(cls)

    def to_dict(self) -> dict:
        out = {"type": self.type, "message": str(self)}
        if self.field:
            out["field"] = self.field
        return out

    @classmethod
    def rebuild(cls, message: str, field: str | None = None) -> ProrlError:
        """The error as a client raises it from a server's body: no constructor runs (some take
        an id or a status, not a message), and str() is the server's message."""
        exc = cls.__new__(cls)
        Exception.__init__(exc, message)
        exc.field, exc.remote = field, True
        return exc


def _register(cls: type[ProrlError]) -> None:
    taken = _REGISTRY.setdefault(cls.type, cls)
    if (taken.__module__, taken.__qualname__) == (cls.__module__, cls.__qualname__):
        _REGISTRY[cls.type] = cls  # itself, or its module imported again
    elif not issubclass(cls, taken) or cls.http_status != taken.http_status:
        raise TypeError(f"{cls.__qualname__}: error type {cls.type!r} is {taken.__qualname__}'s "
                        f"(a subclass may share it, and then its status {taken.http_status})")


_register(ProrlError)


def error_class(type_: str) -> type[ProrlError] | None:
    """The class registered for a wire type (the most general one sharing it); None if unknown."""
    return _REGISTRY.get(type_)


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str = Field(description="Stable machine-readable kind: invalid_request, not_found, conflict ...")
    message: str
    field: str | None = Field(None, description="The offending field, for invalid_request.")


class ErrorBody(BaseModel):
    error: ErrorDetail


def error_body(type_: str, message: str, field: str | None = None, **extra: Any) -> dict[str, Any]:
    """The JSON body of an error answer, ``{"error": {"type", "message", "field"?, ...}}``, for an
    answer that is not a :class:`ProrlError` (``{"error": exc.to_dict()}`` is one's)."""
    detail = {"type": type_, "message": message, **({"field": field} if field else {}), **extra}
    return {"error": detail}


def from_wire(detail: ErrorDetail, status: int, fallback: type[ProrlError] = ProrlError) -> ProrlError:
    """The exception a server's error body stands for: its type's class, else ``fallback`` with
    ``remote_type`` set. The message says the HTTP status."""
    cls = _REGISTRY.get(detail.type)
    exc = (cls or fallback).rebuild(f"{detail.message} (HTTP {status})", detail.field)
    if cls is None:
        exc.remote_type = detail.type
    return exc


class InvalidRequest(ProrlError, ValueError):
    type = "invalid_request"
    http_status = 400

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class PolicyDenied(InvalidRequest):
    """The request asked for what the operator's policy does not allow: a runtime the host does
    not serve, an unregistered image, a repository source outside the allowed ones."""

    type = "policy_denied"
    http_status = 403  # forbidden, on the API as on the sandbox host: the caller may not widen it


class QuotaExceeded(InvalidRequest):
    """What a call would store passes one of the rollout store's byte quotas (``limit``: the
    setting's name, said in the message too); nothing was stored or generated."""

    type = "quota_exceeded"
    http_status = 413

    def __init__(self, message: str, limit: str, field: str | None = None):
        super().__init__(message, field)
        self.limit = limit


class JobIdConflict(InvalidRequest):
    """A submission names a job id that is already stored for a different request (instance or
    sampling parameters): it is never answered with that job's result."""

    type = "job_id_conflict"
    http_status = 409

    def __init__(self, job_id: str):
        super().__init__(f"job id {job_id!r} is already taken by a different request (instance or "
                         "sampling_params); resubmit the same request to get that job, or choose a new job id",
                         field="job_id")
        self.job_id = job_id


class TaskQuarantined(InvalidRequest):
    """The hack audit found the task hackable (``policies`` earned more than a no-op agent) and the
    operator refuses such tasks (``PRORL_AUDIT_POLICY=refuse``) until the task or its grader changes."""

    type = "task_quarantined"
    http_status = 409

    def __init__(self, task: str, policies: list[str], content_hash: str):
        super().__init__(f"task {task!r} is quarantined: the hack audit found it hackable by "
                         f"{', '.join(policies) or 'a policy'}; fix the task or its grader and audit it again "
                         "(prorl-celery audit), or ask the operator (PRORL_AUDIT_POLICY)", field="instance")
        self.task, self.policies, self.content_hash = task, list(policies), content_hash

    def to_dict(self) -> dict:
        out = super().to_dict()
        if hasattr(self, "task"):  # a rebuilt (client-side) error has only the message
            out.update(task=self.task, policies=self.policies, content_hash=self.content_hash)
        return out


class ImageError(InvalidRequest):
    """A sandbox image (``docker://``, ``oci:``) could not be pulled or unpacked."""

    type = "image_error"


class ImageNotFound(ImageError):
    type = "image_not_found"
    http_status = 404


class ImageUnavailable(ImageError):
    type = "image_unavailable"
    http_status = 424


class ImageTooLarge(ImageError):
    type = "image_too_large"
    http_status = 413


class NotFound(ProrlError, KeyError):
    type = "not_found"
    http_status = 404
    what = "id"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.remote else f"unknown {self.what} {self.args[0]!r}"


class UnknownJob(NotFound):
    what = "job id"


class UnknownGroup(NotFound):
    what = "group id"


class UnknownBackend(NotFound):
    what = "LLM backend id"


class UnknownProject(NotFound):
    what = "project (or key id)"


class JobAlreadyTerminal(ProrlError):
    type = "conflict"
    http_status = 409
    status: str = ""  # the job's, said in the body beside the error's type

    def __init__(self, job_id: str, status: str):
        super().__init__(f"job {job_id!r} already ended with status {status!r}")
        self.job_id = job_id
        self.status = status

    def to_dict(self) -> dict:
        return {**super().to_dict(), "status": self.status}


class JobCancelled(ProrlError):
    type = "cancelled"


class StageBudgetExceeded(ProrlError, TimeoutError):
    type = "timeout"
    http_status = 504  # as the reference API's /process says of a job out of time


class UnknownPlugin(ProrlError, LookupError):
    type = "unknown_plugin"
    http_status = 400

    def __str__(self) -> str:
        return str(self.args[0])


class FileError(ProrlError, OSError):
    """A file operation in a sandbox failed: task-level (the agent asked for it), never retried.
    In process the runtimes raise the built-ins; the host sends them as these."""

    type = "file_error"
    http_status = 400

    @classmethod
    def wrap(cls, exc: OSError) -> FileError:
        """The most specific FileError that also is what ``exc`` is (FileMissing for a
        FileNotFoundError ...)."""
        kinds = [kind for kind in _REGISTRY.values()
                 if issubclass(kind, cls) and isinstance(exc, _builtin_of(kind))]
        kind = max(kinds, key=lambda k: len(_builtin_of(k).__mro__))
        return kind(f"{type(exc).__name__}: {exc}")


def _builtin_of(kind: type[FileError]) -> type[OSError]:
    return next(base for base in kind.__mro__ if not issubclass(base, ProrlError))


class FileMissing(FileError, FileNotFoundError):
    type = "file_not_found"
    http_status = 404


class FileDenied(FileError, PermissionError):
    type = "permission_denied"
    http_status = 403


class SandboxError(ProrlError):
    type = "sandbox"


class NoSandboxCapacity(SandboxError):
    type = "no_sandbox_capacity"
    http_status = 503


class SandboxGone(SandboxError):
    type = "sandbox_gone"
    http_status = 404


class FileTooLarge(SandboxError, OSError):
    """A file read through the host is larger than ``sandbox_read_max_mb`` (or the caller's cap)."""

    type = "file_too_large"
    http_status = 413

    def __init__(self, message: str):
        SandboxError.__init__(self, message)
        self.errno, self.strerror, self.filename = errno.EFBIG, message, None

    def __str__(self) -> str:
        return str(self.args[0])


class EnvBuildFailed(SandboxError):
    """An environment could not be built (a command failed, timed out, or the node lacks what
    the recipe needs)."""

    type = "env_build_failed"


class VerifierFailed(ProrlError):
    """A task's verifier could not grade: an infrastructure fault for the result, not a reward."""

    type = "verifier_failed"


class VerifierTimedOut(VerifierFailed):
    """The verifier ran past its timeout."""

    type = "verifier_timeout"


class VerifierNoReward(VerifierFailed):
    """The verifier ended without a readable reward."""

    type = "verifier_no_reward"


class ImageBuildFailed(ProrlError):
    """A Dockerfile could not be built into an image: refused (an instruction or base this node
    cannot honour), failed (a RUN exited non-zero, with the log's tail) or timed out."""

    type = "image_build_failed"


class SidecarFailed(ProrlError):
    """A task's sidecar service (docker-compose.yaml) exited or never got healthy before what
    depends on it could start: an infrastructure fault naming the service, not a reward."""

    type = "sidecar_failed"


class UnsafeDirectory(SandboxError):
    """A directory the host would use is not safely its own."""

    type = "unsafe_directory"


class TooManyStreams(ProrlError):
    """A client (or all clients together) holds as many long-lived requests as allowed."""

    type = "too_many_requests"
    http_status = 429


class RateLimited(TooManyStreams):
    """A gateway session's operations came faster than its rate, or more at once than its
    concurrency cap (``reason``: ``rate`` or ``max_concurrent``); retry later."""

    def __init__(self, reason: str):
        super().__init__(f"the session's gateway is rate-limited: {reason}")
        self.reason = reason


class OverQuota(TooManyStreams):
    """A project's submission while it is at one of its quotas whose ``over`` is 429
    (:mod:`prorl_celery.quotas`): nothing was stored; retry after ``retry_after`` seconds."""

    type = "over_quota"
    quota: str | None = None
    limit: int | None = None
    retry_after: int | None = None  # also the answer's Retry-After header

    def __init__(self, project: str, quota: str, limit: int, retry_after: int):
        super().__init__(f"project {project!r} is at its quota {quota} ({limit}); retry after {retry_after}s")
        self.quota, self.limit, self.retry_after = quota, limit, retry_after

    def to_dict(self) -> dict:
        named = {"quota": self.quota, "limit": self.limit, "retry_after": self.retry_after}
        return {**super().to_dict(), **{k: v for k, v in named.items() if v is not None}}


class StoreUnavailable(ProrlError):
    """The job store (Redis) cannot answer now: down, restarting, or loading its AOF. Nothing
    was done; the client retries (``Retry-After``), as it does any 503."""

    type = "store_unavailable"
    http_status = 503


class StoreLayoutMismatch(ProrlError):
    """A process's ``store_shards`` names other shards, or another order, than the store was
    started with (prorl_celery/shards.py): it would write rollouts where no reader looks. Raised
    when a worker or the API starts, before it serves anything."""

    type = "store_layout_mismatch"


class RolloutFailed(ProrlError):
    """A rollout the trainer asked for gave no trajectory it can train on."""

    type = "rollout_failed"


class LLMError(ProrlError):
    type = "llm"


class BackendFailed(LLMError):
    """One call to one backend failed in a way that says the backend is unwell."""

    type = "backend_failed"


class LogprobMismatch(BackendFailed):
    """The server answered a logprob count other than its token count: never padded, retried elsewhere."""

    type = "logprob_mismatch"


class BackendAborted(BackendFailed):
    """The server aborted the request itself (SGLang during a weight update): retried, the backend
    stays in rotation."""

    type = "backend_aborted"


class PartialAborted(BackendAborted):
    """The server ended the request for a weight update and answered the tokens it had generated
    (vLLM ``/pause?mode=abort``, SGLang ``pause_generation``): the turn goes on from them
    (``partial``: a :class:`prorl_celery.llm.models.PartialResponse`)."""

    type = "partial_aborted"

    def __init__(self, message: str, partial: object = None):
        super().__init__(message)
        self.partial = partial


class BackendUnavailable(LLMError):
    type = "backend_unavailable"


class ContextWindowExceeded(LLMError):
    type = "context_window_exceeded"


class LLMTimeout(LLMError, TimeoutError):
    """A call given less than ``llm_call_timeout_s`` (the caller's deadline) ran out of it."""

    type = "llm_timeout"


class LLMRequestRejected(LLMError):
    type = "llm_request_rejected"


class LLMCallCancelled(LLMError, JobCancelled):
    """Subclasses JobCancelled so that a stage ends ``cancelled``, not failed."""

    type = "cancelled"


class BudgetSpent(LLMError):
    """A gateway session's budget (calls, tokens or wall time) is spent; ``reason`` says which."""

    def __init__(self, reason: str):
        super().__init__(f"the session's budget is spent: {reason}")
        self.reason = reason
