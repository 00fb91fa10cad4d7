"""A small Python client for trainers: submit, wait, stream completions, cancel, manage backends.

Every submission carries a client-made job id, so retrying a request that may or may not have
reached the service never runs a job twice.

    client = ProrlClient("http://head:8000", token=...)

Without a token (or a URL) it takes ``PRORL_API_TOKEN`` (``PRORL_API_URL``) from the environment,
else from ``<state dir>/secrets.env``, the 0600 file ``prorl-celery up`` writes (``state_dir=``
or ``$PRORL_STATE_DIR``).
    ids = [client.submit({"data_source": "math", ...}) for _ in range(8)]
    for view in client.as_completed(ids):
        print(view["job_id"], view["result"]["reward"])
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import requests

from prorl_celery.backoff import Backoff, wait
from prorl_celery.errors import ProrlError, error_class
from prorl_celery.statedir import lookup
from prorl_celery.status import TERMINAL

_RETRY_STATUS = {502, 503, 504}
_BACKOFF = Backoff(first_s=0.2, max_s=5.0)  # before each retry of a call
_TERMINAL = frozenset(status.value for status in TERMINAL)
# as_completed's reads: after the first completion, gather others this long (one request per
# linger instead of one per completion when rollouts end at hundreds a second)
LINGER_S = 0.05


class ProrlClientError(RuntimeError):
    """The service answered with an error; ``status`` (the HTTP status) and ``error`` hold its
    JSON error. An answer of a type in :mod:`prorl_celery.errors` is raised as that class too
    (:func:`raised_for`), so ``except errors.InvalidRequest`` (or ``errors.NotFound`` ...) works
    beside ``except ProrlClientError``; ``field`` names the offending field, if any."""

    field: str | None = None

    def __init__(self, status: int, error: dict[str, Any]):
        super().__init__(_message(status, error))
        self.status, self.error, self.field = status, error, error.get("field")

    def __reduce__(self) -> tuple[Any, ...]:  # pickled (a trainer's worker to its driver) as the answer
        return raised_for, (self.status, self.error)


def _message(status: int, error: dict[str, Any]) -> str:
    return f"HTTP {status}: {error.get('type')}: {error.get('message')}"


_TYPED: dict[type[ProrlError], type[ProrlClientError]] = {}


def _typed(kind: type[ProrlError]) -> type[ProrlClientError]:
    """The registered class ``kind`` as the client raises it: also a ProrlClientError. Made once
    per class from the registry, so a new error type needs nothing here."""
    if kind not in _TYPED:
        _TYPED[kind] = type(kind.__name__, (kind, ProrlClientError),
                            {"__module__": __name__, "__qualname__": kind.__qualname__})
    return _TYPED[kind]


def raised_for(status: int, error: dict[str, Any]) -> ProrlClientError:
    """The exception for an error answer: its type's registered class (no constructor runs:
    some take an id, not a message), else a plain ProrlClientError."""
    kind = error_class(str(error.get("type")))
    if kind is None:
        return ProrlClientError(status, error)
    exc = _typed(kind).rebuild(_message(status, error), error.get("field"))
    exc.status, exc.error = status, error  # the HTTP status; a conflict's job status is in error
    return exc  # type: ignore[return-value]


def _error_of(resp: requests.Response) -> dict[str, Any]:
    try:
        error = resp.json().get("error")
    except (ValueError, AttributeError):  # not JSON, or not an object
        error = None
    return error if isinstance(error, dict) else {"type": "http", "message": resp.text[:500]}


class ProrlClient:
    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 60.0,
                 retries: int = 5, state_dir: str | None = None):
        url = url or lookup("PRORL_API_URL", state_dir)
        if not url:
            raise ValueError("give the API's url, or set PRORL_API_URL or PRORL_STATE_DIR")
        self.url = url.rstrip("/")
        token = token or lookup("PRORL_API_TOKEN", state_dir)
        self.timeout, self.retries = timeout, retries
        self.session = requests.Session()
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"

    # -- transport ------------------------------------------------------------------------
    def _call(self, method: str, path: str, *, ok: tuple[int, ...] = (200, 201, 202),
              timeout: float | None = None, **kwargs: Any) -> requests.Response:
        for attempt in range(self.retries + 1):
            try:
                resp = self.session.request(method, self.url + path, timeout=timeout or self.timeout, **kwargs)
            except (requests.ConnectionError, requests.Timeout):
                if attempt == self.retries:
                    raise
            else:
                if resp.status_code in ok:
                    return resp
                if resp.status_code not in _RETRY_STATUS or attempt == self.retries:
                    raise raised_for(resp.status_code, _error_of(resp))
            wait(_BACKOFF.pause(attempt + 1))
        raise AssertionError("unreachable")

    # -- jobs -----------------------------------------------------------------------------
    def submit(self, instance: dict[str, Any], sampling_params: dict[str, Any] | None = None,
               job_id: str | None = None, group_id: str | None = None, priority: int | None = None) -> str:
        """One job; ``priority``: within the key's project, a higher one is released first."""
        return self.submit_many([{"instance": instance, "sampling_params": sampling_params or {},
                                  "job_id": job_id, "group_id": group_id, "priority": priority}])[0]

    def submit_many(self, jobs: Iterable[dict[str, Any]]) -> list[str]:
        body = [{**job, "job_id": job.get("job_id") or uuid.uuid4().hex} for job in jobs]
        body = [{k: v for k, v in job.items() if v is not None} for job in body]
        return self._call("POST", "/jobs", json={"jobs": body}).json()["job_ids"]

    def submit_group(self, instance: dict[str, Any], n: int, sampling_params: dict[str, Any] | None = None,
                     group_id: str | None = None, priority: int | None = None) -> tuple[str, list[str]]:
        body = {"instance": instance, "n": n, "sampling_params": sampling_params or {},
                "group_id": group_id or uuid.uuid4().hex, **({"priority": priority} if priority is not None else {})}
        reply = self._call("POST", "/groups", json=body).json()
        return reply["group_id"], reply["job_ids"]

    def get(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/jobs/{job_id}").json()

    def group(self, group_id: str) -> dict[str, Any]:
        return self._call("GET", f"/groups/{group_id}").json()

    def wait(self, job_id: str, timeout: float | None = None, poll_s: float = 30.0) -> dict[str, Any]:
        """The job once terminal; raises TimeoutError if ``timeout`` passes first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic()))
            resp = self._call("GET", f"/jobs/{job_id}/wait", params={"timeout": left}, timeout=left + 30)
            if resp.status_code == 200:
                return resp.json()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} still {resp.json()['status']} after {timeout}s")

    def completions(self, cursor: str | None = None, wait: float = 0.0, group_id: str | None = None,
                    limit: int = 500, linger: float = 0.0) -> dict[str, Any]:
        """``GET /completions``: up to ``limit`` after ``cursor``, waiting up to ``wait`` s for
        the first and then ``linger`` s more for others."""
        params = {"cursor": cursor or "0-0", "wait": wait, "limit": limit}
        if group_id:
            params["group_id"] = group_id
        if linger:
            params["linger"] = linger
        return self._call("GET", "/completions", params=params, timeout=wait + 30).json()

    def as_completed(self, job_ids: Iterable[str] | None = None, group_id: str | None = None,
                     timeout: float | None = None, linger: float = LINGER_S) -> Iterator[dict[str, Any]]:
        """Yield each job's record as it finishes, in completion order, each exactly once:
        the given ``job_ids``, or every job of ``group_id``. ``linger``: how long each read
        gathers more after its first (a read asks for no more than are still pending, so the
        last ones are not held back)."""
        if job_ids is None:
            if not group_id:
                raise ValueError("give job_ids, group_id, or both")
            job_ids = [sample["job_id"] for sample in self.group(group_id)["samples"]]
        pending = set(job_ids)
        if group_id:
            cursor = "0-0"  # the group's own stream holds all of its completions
        else:
            cursor = self.completions("latest")["cursor"]
            for job_id in list(pending):  # whatever finished before that cursor
                view = self.get(job_id)
                if view["status"] in _TERMINAL:
                    pending.discard(job_id)
                    yield view
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = 10.0 if deadline is None else max(0.0, min(10.0, deadline - time.monotonic()))
            batch = self.completions(cursor, left, group_id, limit=min(500, len(pending)), linger=linger)
            cursor = batch["cursor"]
            for item in batch["completions"]:
                if item["job_id"] in pending:
                    pending.discard(item["job_id"])
                    yield item["job"]
            if pending and deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{len(pending)} job(s) still running after {timeout}s")

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/jobs/{job_id}").json()

    def cancel_group(self, group_id: str) -> list[str]:
        return self._call("DELETE", f"/groups/{group_id}").json()["cancelled"]

    def cancel_all(self, group_id: str | None = None, data_source: str | None = None) -> int:
        body = {k: v for k, v in {"group_id": group_id, "data_source": data_source}.items() if v}
        return self._call("POST", "/cancel_all", json=body).json()["cancelled"]

    def audit(self) -> dict[str, Any]:
        """The hack audit's verdicts (``GET /audit``): ``{policy, verdicts: [...]}``."""
        return self._call("GET", "/audit").json()

    # -- inference backends ---------------------------------------------------------------
    def add_llm_server(self, address: str, **fields: Any) -> dict[str, Any]:
        return self._call("POST", "/llm_servers", json={"address": address, **fields}).json()

    def llm_servers(self) -> list[dict[str, Any]]:
        return self._call("GET", "/llm_servers").json()["backends"]

    def remove_llm_server(self, backend_id: str) -> None:
        self._call("DELETE", f"/llm_servers/{backend_id}")

    def drain(self, ids: list[str] | None = None, wait: float | None = None, abort: bool = False) -> dict:
        body = {k: v for k, v in {"ids": ids, "wait": wait, "abort": abort}.items() if v is not None}
        return self._call("POST", "/llm_servers/drain", json=body, timeout=(wait or 0) + 60).json()

    def resume(self, ids: list[str] | None = None, weight_version: str | None = None) -> dict:
        body = {k: v for k, v in {"ids": ids, "weight_version": weight_version}.items() if v is not None}
        return self._call("POST", "/llm_servers/resume", json=body).json()

    def pause(self, mode: str = "keep", ids: list[str] | None = None, wait: float | None = None,
              max_pause_s: float | None = None) -> dict:
        """Pause backends for a weight update (keep | abort | drain); returns once it is safe to
        write weights (``safe``), with the seconds it took (``pause_s``) and each backend's mode.
        Write the weights, then :meth:`resume` with the new ``weight_version``. With no resume,
        the pause expires after ``max_pause_s`` (at most the operator's ``PRORL_LLM_MAX_PAUSE_S``,
        the default): the backends go on with the weights they had (``expires_at`` says when)."""
        body = {k: v for k, v in {"mode": mode, "ids": ids, "wait": wait, "max_pause_s": max_pause_s}.items()
                if v is not None}
        return self._call("POST", "/llm_servers/pause", json=body, timeout=(wait or 60) + 60).json()

    def ack(self, job_ids: list[str]) -> dict:
        """The trainer consumed these results: they stop holding back admission (``max_staleness``)."""
        return self._call("POST", "/jobs/ack", json={"job_ids": list(job_ids)}).json()

    def weights(self) -> dict:
        """``{"current", "oldest_unconsumed", "unconsumed"}``: the versions' ordinals (staleness)."""
        return self._call("GET", "/weights").json()

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/healthz").json()
