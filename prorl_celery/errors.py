"""Exceptions raised inside the service.

Task-level outcomes (a command exits 1, a test fails, a wrong answer) are data in the result, not
exceptions. What follows is for infrastructure faults and bad input::

    ProrlError
    ├── InvalidRequest(ValueError)        bad input from a client; carries the field
    │   ├── PolicyDenied                  beyond the operator's policy (runtime, image, repo source)
    │   └── ImageError                    a sandbox image could not be had; names the field
    │       ├── ImageNotFound             no such image, tag or digest in its registry
    │       ├── ImageUnavailable          registry unreachable, pull timed out, unpack failed
    │       └── ImageTooLarge             beyond the sandbox host's image cache budget
    ├── NotFound(KeyError)                no such id
    │   ├── UnknownJob                    no such job
    │   ├── UnknownGroup                  no such group
    │   └── UnknownBackend                no such LLM backend
    ├── JobAlreadyTerminal                the job ended before the operation could act
    ├── JobCancelled                      raised inside a stage when its job was cancelled
    ├── StageBudgetExceeded(TimeoutError) a stage ran past its time budget
    ├── UnknownPlugin(LookupError)        a handler or runtime name that is not registered
    ├── SandboxError                      a sandbox or sandbox host failed
    │   ├── NoSandboxCapacity             every live host is full (retried by init)
    │   └── SandboxGone                   the sandbox no longer exists (lease lapsed, host died)
    └── LLMError                          an inference backend or the LLM pool failed
        ├── BackendFailed                 one call failed (connection, 5xx, timeout); retried
        │   ├── LogprobMismatch           the answer's logprobs do not match its tokens (one each)
        │   └── BackendAborted            the server aborted the request (weight update): retried, no quarantine
        ├── BackendUnavailable            retry budget spent, or no backend came up in time
        ├── ContextWindowExceeded         the conversation no longer fits the model's context
        ├── LLMTimeout(TimeoutError)      the caller's own (shortened) call timeout passed
        ├── LLMRequestRejected            the server refused the request (4xx); not retried
        └── LLMCallCancelled(JobCancelled) the caller's should_stop() fired; the call was aborted
"""
from __future__ import annotations


class ProrlError(Exception):
    """Root of every exception the service raises on purpose."""

    type: str = "error"

    def to_dict(self) -> dict:
        return {"type": self.type, "message": str(self)}


class InvalidRequest(ProrlError, ValueError):
    type = "invalid_request"

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field

    def to_dict(self) -> dict:
        out = super().to_dict()
        if self.field:
            out["field"] = self.field
        return out


class PolicyDenied(InvalidRequest):
    """The request asked for what the operator's policy does not allow: a runtime the host does
    not serve, an unregistered image, a repository source outside the allowed ones."""

    type = "policy_denied"


class ImageError(InvalidRequest):
    """A sandbox image (``docker://``, ``oci:``) could not be pulled or unpacked."""

    type = "image_error"


class ImageNotFound(ImageError):
    type = "image_not_found"


class ImageUnavailable(ImageError):
    type = "image_unavailable"


class ImageTooLarge(ImageError):
    type = "image_too_large"


class NotFound(ProrlError, KeyError):
    type = "not_found"
    what = "id"

    def __str__(self) -> str:  # KeyError would repr() the message
        return f"unknown {self.what} {self.args[0]!r}"


class UnknownJob(NotFound):
    what = "job id"


class UnknownGroup(NotFound):
    what = "group id"


class JobAlreadyTerminal(ProrlError):
    type = "conflict"

    def __init__(self, job_id: str, status: str):
        super().__init__(f"job {job_id!r} already ended with status {status!r}")
        self.job_id = job_id
        self.status = status


class JobCancelled(ProrlError):
    type = "cancelled"


class StageBudgetExceeded(ProrlError, TimeoutError):
    type = "timeout"


class UnknownPlugin(ProrlError, LookupError):
    type = "unknown_plugin"

    def __str__(self) -> str:
        return str(self.args[0])


class SandboxError(ProrlError):
    type = "sandbox"


class NoSandboxCapacity(SandboxError):
    type = "no_sandbox_capacity"


class SandboxGone(SandboxError):
    type = "sandbox_gone"


class LLMError(ProrlError):
    type = "llm"


class UnknownBackend(NotFound):
    what = "LLM backend id"


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
