"""Drive a sandbox on any host by its handle, and place new sandboxes on the least-loaded host."""
from __future__ import annotations

import logging
import random
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis
from pydantic import BaseModel, ValidationError

from prorl_celery import keys
from prorl_celery.backoff import Backoff, wait
from prorl_celery.errors import (ErrorBody, ErrorDetail, FileTooLarge, ImageError, ImageUnavailable,
                                 NoSandboxCapacity, SandboxError, SandboxGone, from_wire)
from prorl_celery.http import Response, TransportError
from prorl_celery.http import request as http_request
from prorl_celery.plugins import is_dotted_path
from prorl_celery.redisio import LuaScript
from sandboxes.base import ExecResult, SandboxHandle, SandboxSpec
from sandboxes.gateway_route import GatewayRoute, close_gateway_route, gateway_route
from sandboxes.protocol import (METHODS, CloseManyRequest, CloseManyResponse, CreateRequest, Empty,
                                FinishResponse, HostRecord, LayerEntry, LayerList, RelayResponse, RemoveLayersRequest,
                                RemoveLayersResponse, SandboxEntry, SandboxUsage, StatResult, StopStraysRequest,
                                StopStraysResponse, Stray, StrayList)
from sandboxes.registry import AUTO, requested_runtime

log = logging.getLogger(__name__)

HTTP_MARGIN_S = 15.0  # exec's HTTP timeout beyond the command's: kill grace, shell restart, network
CONTROL_TIMEOUT_S = 30.0
CREATE_TIMEOUT_S = 300.0  # starting a container may pull or unpack an image
CLOSE_BATCH = 10_000  # sandboxes per bulk close (as many as the protocol takes): one call, so one
# kill loop on the host; four calls of 250 at once left one loop starved by the others' teardowns
CLOSE_THREADS = 8  # bulk close calls at once, to different hosts (each mostly waits on its host)


def _raise_for(response: Response) -> None:
    """Raise the class a host's error body names (prorl_celery.errors); SandboxError for a type
    this side does not know, or a body that is not one (a proxy's page, a crashed route)."""
    try:
        detail = ErrorBody.model_validate_json(response.content).error
    except ValidationError:
        detail = ErrorDetail(type=SandboxError.type, message=response.text[:500])
    raise from_wire(detail, response.status_code, fallback=SandboxError)


def request(method: str, address: str, token: str, path: str, timeout: float,
            **kwargs: Any) -> Response:
    """One call to a sandbox host (``params``, ``data``, ``stream`` as in requests); maps
    transport failures (cause: :class:`~prorl_celery.http.TransportError`) and error bodies to
    exceptions."""
    try:
        response = http_request(method, address + path, headers={"Authorization": f"Bearer {token}"},
                                timeout=timeout, **kwargs)
    except TransportError as exc:
        raise SandboxError(f"sandbox host {address} unreachable: {exc}") from exc
    if response.status_code >= 400:
        if kwargs.get("stream"):
            response.content  # noqa: B018 - read the error body in full
        _raise_for(response)
    return response


class RemoteSandbox:
    """The :class:`~sandboxes.base.Sandbox` protocol over HTTP to the host named in ``handle``:
    every method is one :meth:`_call` of its row in :data:`sandboxes.protocol.METHODS`."""

    def __init__(self, handle: SandboxHandle, entry: SandboxEntry | None = None):
        self.handle = handle
        self.entry = entry  # the host's answer to the create (runtime, isolation, limits ...)
        self.gone = False  # the host said so: closing it again is no call (a bulk cancel's 1,000)
        self.usage: SandboxUsage | None = None  # what it used, as the host read it at its close

    def _call(self, name: str, body: BaseModel) -> BaseModel:
        """One protocol method on the host: its request model in, its response model out."""
        method = METHODS[name]
        path = f"/sandboxes/{self.handle.sandbox_id}/{name}"
        fields = body.model_dump(exclude={"data"}, exclude_none=True) if method.raw_request else None
        try:
            response = request("POST", self.handle.address, self.handle.token, path, _http_timeout(body),
                               params=fields, data=body.data if method.raw_request  # type: ignore[attr-defined]
                               else body.model_dump_json())
        except SandboxGone:
            self.gone = True
            raise
        if method.raw_response:
            return method.response(data=response.content)
        return method.response.model_validate_json(response.content)

    def _invoke(self, name: str, **args: Any) -> Any:
        method = METHODS[name]
        return method.result(self._call(name, method.request(**args)))

    def exec(self, command: str, timeout: float | None = None) -> ExecResult:
        from config.settings import get_settings  # this side's default, as the HTTP timeout's

        return self._invoke("exec", command=command, timeout=timeout or get_settings().action_timeout_s)

    def interrupt(self) -> None:
        self._invoke("interrupt")

    def renew(self, lease_s: float | None = None) -> SandboxEntry:
        return self._invoke("renew", lease_s=lease_s)

    def relay(self, socket: str, target: str | None = None, close: bool = False,
              key: str | None = None) -> RelayResponse:
        """The host's way for this sandbox to a harness session's gateway socket (host-only:
        :meth:`sandboxes.host.pool.SandboxPool.relay`); ``key``: the session's relay key, with
        ``target``."""
        return self._invoke("relay", socket=socket, target=target, close=close, key=key)

    def forward(self, to: str, ports: list[int]) -> list[int]:
        """``ports`` of the sandbox ``to`` (this job's, on this host) reached at 127.0.0.1 in this
        one (host-only: :meth:`sandboxes.host.pool.SandboxPool.forward`)."""
        return self._invoke("forward", to=to, ports=ports)

    def read_file(self, path: str) -> bytes:
        return self._invoke("read_file", path=path)

    def write_file(self, path: str, data: bytes) -> None:
        from config.settings import get_settings

        cap = get_settings().sandbox_write_max_mb << 20
        if len(data) >= cap:  # the host refuses it from its head (413): said here, not as a reset mid-send
            raise FileTooLarge(f"{path}: {len(data)} bytes is more than a sandbox host takes in one "
                               f"write (sandbox_write_max_mb={cap >> 20})")
        self._invoke("write_file", path=path, data=data)

    def stat(self, path: str) -> StatResult:
        return self._invoke("stat", path=path)

    def export_tree(self, paths: list[str], max_bytes: int) -> bytes:
        return self._invoke("export_tree", paths=paths, max_bytes=max_bytes)

    def finish(self, paths: list[str], max_bytes: int, settle_s: float = 0.0) -> FinishResponse:
        """The sandbox killed, ``paths`` read, the sandbox closed (its host forgets it); what it
        used is kept in ``usage``."""
        files = self._invoke("finish", paths=paths, max_bytes=max_bytes, settle_s=settle_s)
        self.gone, self.usage = True, files.usage
        return files

    def freeze(self, layer: str, group_id: str | None = None, job_id: str | None = None,
               timeout: float = 600.0) -> LayerEntry:
        """The sandbox killed, its root's changes frozen into ``layer``, the sandbox closed."""
        entry = self._invoke("freeze", layer=layer, group_id=group_id, job_id=job_id, timeout=timeout)
        self.gone = True
        return entry

    def close(self) -> bool:
        """True if this call closed it, False if it was already gone. Idempotent. What it used
        (the host's reading at the close; None: not measured) is kept in ``usage``."""
        if self.gone:
            return False
        answer = self._call("close", Empty())
        self.usage = answer.usage
        return answer.closed

    def info(self) -> dict[str, Any]:
        return {**self._invoke("info"), "address": self.handle.address}


def _http_timeout(body: BaseModel) -> float:
    """A call's HTTP timeout: a command's own timeout and a margin, or the control timeout."""
    timeout = getattr(body, "timeout", None)
    return CONTROL_TIMEOUT_S if timeout is None else timeout + HTTP_MARGIN_S


def list_layers(address: str, token: str) -> list[LayerEntry]:
    """The frozen layers of the host's node (:mod:`sandboxes.runtimes.layers`)."""
    response = request("GET", address, token, "/layers", CONTROL_TIMEOUT_S)
    return LayerList.model_validate_json(response.content).layers


def remove_layers(address: str, token: str, names: list[str]) -> list[str]:
    """Have the host remove these layers of its node; returns those removed (not those in use)."""
    response = request("POST", address, token, "/layers/remove", CREATE_TIMEOUT_S,
                       data=RemoveLayersRequest(layers=names).model_dump_json())
    return RemoveLayersResponse.model_validate_json(response.content).removed


def list_sandboxes(address: str, token: str) -> list[SandboxEntry]:
    response = request("GET", address, token, "/sandboxes", CONTROL_TIMEOUT_S)
    return [SandboxEntry.model_validate(item) for item in response.json()["sandboxes"]]


def close_many(address: str, token: str, sandbox_ids: list[str]) -> list[str]:
    """Close these sandboxes of one host in one call; returns those this call closed (the others
    were already gone)."""
    body = CloseManyRequest(sandbox_ids=sandbox_ids).model_dump_json()
    response = request("POST", address, token, "/sandboxes/close", CONTROL_TIMEOUT_S, data=body)
    return CloseManyResponse.model_validate_json(response.content).closed


def list_strays(address: str, token: str) -> list[Stray]:
    """What runs on a host's node outside any host (:meth:`~sandboxes.base.SandboxRuntime.strays`)."""
    return StrayList.model_validate_json(request("GET", address, token, "/strays", CONTROL_TIMEOUT_S).content).strays


def stop_strays(address: str, token: str, strays: list[Stray]) -> StopStraysResponse:
    body = StopStraysRequest(strays=strays).model_dump_json()
    response = request("POST", address, token, "/strays/stop", CREATE_TIMEOUT_S, data=body)
    return StopStraysResponse.model_validate_json(response.content)


# -- closing by handle: the one way the service closes a job's sandbox -----------------------
def handle_of(host: HostRecord, entry: SandboxEntry) -> SandboxHandle:
    """The handle of the sandbox ``entry`` on ``host`` (as the host listed or created it)."""
    return SandboxHandle(host_id=host.host_id, address=host.address, token=host.token,
                         sandbox_id=entry.sandbox_id, runtime=entry.runtime)


def close_handle(handle: SandboxHandle | dict[str, Any], *, raise_errors: bool = False) -> bool:
    """Close the sandbox a handle (or the dict a job record stores) names. True if this call
    closed it; False if it was already gone, which is not an error.

    Any other failure (its host unreachable, a malformed handle) is logged and gives False:
    a host kills a sandbox whose lease lapsed (or died with it), and a caller closing on its way
    out must not have its own outcome hidden. ``raise_errors`` raises it instead, for a caller
    that reports the host (the sweep)."""
    return close_measured(handle, raise_errors=raise_errors)[0]


def close_measured(handle: SandboxHandle | dict[str, Any], *,
                   raise_errors: bool = False) -> tuple[bool, SandboxUsage | None]:
    """:func:`close_handle`, and what the sandbox (and its sidecars) used, as its host read it at
    the close (None: already gone, or not measured)."""
    try:
        box = RemoteSandbox(SandboxHandle.model_validate(handle))
        return box.close(), box.usage
    except SandboxGone:
        return False, None
    except Exception as exc:  # noqa: BLE001 - see above
        if raise_errors:
            raise
        sandbox_id = handle.get("sandbox_id") if isinstance(handle, dict) else handle.sandbox_id
        log.warning("could not close sandbox %s: %s", sandbox_id, exc)
        return False, None


def close_handles(handles: list[SandboxHandle | dict[str, Any]]) -> list[str]:
    """:func:`close_handle` of many (a bulk cancel): CLOSE_BATCH sandboxes to a call to their
    host, a few calls at once. Returns the ids this closed; a host's failure is logged, not raised."""
    by_host: dict[tuple[str, str], list[str]] = defaultdict(list)
    for handle in (SandboxHandle.model_validate(h) for h in handles):
        by_host[(handle.address, handle.token)].append(handle.sandbox_id)
    calls = [(host, ids[i:i + CLOSE_BATCH]) for host, ids in by_host.items()
             for i in range(0, len(ids), CLOSE_BATCH)]
    if len(calls) <= 1:
        return [sandbox_id for call in calls for sandbox_id in _close_batch(call)]
    with ThreadPoolExecutor(max_workers=min(CLOSE_THREADS, len(calls))) as pool:
        return [sandbox_id for closed in pool.map(_close_batch, calls) for sandbox_id in closed]


def _close_batch(call: tuple[tuple[str, str], list[str]]) -> list[str]:
    (address, token), ids = call
    try:
        return close_many(address, token, ids)
    except Exception as exc:  # noqa: BLE001 - as in close_handle
        log.warning("could not close %d sandboxes on %s: %s", len(ids), address, exc)
        return []


# KEYS[1]: the hosts' heartbeat set; ARGV[1]: the oldest heartbeat of a live host; ARGV[2]: the
# prefix of a host's hash. Each live host's hash (HGETALL's flat list; empty if it expired).
_LIVE_HOSTS = LuaScript("""
local out = {}
for i, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[1], '+inf')) do
  out[i] = redis.call('HGETALL', ARGV[2] .. id)
end
return out
""")


def live_hosts(client: redis.Redis, runtime: str | None = None) -> list[HostRecord]:
    """Hosts whose heartbeat is recent (3 periods), optionally those offering ``runtime`` (all of
    them when none does: each host applies its own policy and says why it refuses)."""
    from config.settings import get_settings

    cutoff = time.time() - 3 * get_settings().host_heartbeat_s
    found = _LIVE_HOSTS(client, [keys.hosts()], [cutoff, keys.host("")])  # one round trip, by digest
    records = []
    for flat in found:
        raw = dict(zip(flat[::2], flat[1::2]))
        try:
            records.append(HostRecord.from_redis(raw))
        except (ValidationError, ValueError) as exc:  # a half-expired or foreign hash
            log.warning("ignoring malformed sandbox host record: %s", exc)
    if runtime == AUTO:  # hosts that can honour it first; else all, so one says why not
        return [record for record in records if record.auto] or records
    if runtime is None or is_dotted_path(runtime):
        return records
    # no host offers it: ask them anyway, and the first says why not (403) instead of init
    # waiting out its budget for a host that will never come
    return [record for record in records if runtime in record.runtimes] or records


def open_sandbox(client: redis.Redis, spec: SandboxSpec, job_id: str,
                 lease_s: float | None = None, keeper: SandboxHandle | None = None) -> RemoteSandbox:
    """Create a sandbox on the live host with the most free slots (ties broken at random); with
    ``keeper``, on the keeper's host, sharing its lifetime (``CreateRequest.keeper``).

    Hosts race: a host that turns out full or unreachable is skipped for the next one. Raises
    :class:`NoSandboxCapacity` when none could take it (the caller retries later), and
    :class:`SandboxError` when every host answered with a failure of its own.
    """
    runtime = requested_runtime(spec)  # "auto" is resolved by the host that takes it
    hosts = [host for host in live_hosts(client, runtime) if host.free > 0
             and (keeper is None or host.host_id == keeper.host_id)]
    random.shuffle(hosts)
    hosts.sort(key=lambda host: host.free, reverse=True)  # stable: shuffled order breaks ties
    body = CreateRequest(job_id=job_id, spec=spec, lease_s=lease_s,
                         keeper=keeper.sandbox_id if keeper else None).model_dump_json()
    full: list[str] = []
    failed: list[str] = []
    for host in hosts:
        try:
            response = request("POST", host.address, host.token, "/sandboxes", CREATE_TIMEOUT_S,
                               data=body)
        except NoSandboxCapacity:
            full.append(host.host_id)
            continue
        except SandboxError as exc:
            if isinstance(exc.__cause__, TransportError):  # unreachable: no room either
                full.append(f"{host.host_id} (unreachable)")
                continue
            if type(exc) is not SandboxError:  # SandboxGone etc.: not a placement problem
                raise
            failed.append(f"{host.host_id}: {exc}")
            continue
        entry = SandboxEntry.model_validate_json(response.content)
        return RemoteSandbox(handle_of(host, entry), entry)
    if failed and not full:  # hosts answered with a real failure: retrying will not help
        raise SandboxError(f"every sandbox host failed to create the sandbox: {'; '.join(failed)}")
    raise NoSandboxCapacity(f"no live sandbox host with room for runtime {runtime!r}"
                            + (f"; full or unreachable: {', '.join(full)}" if full else "")
                            + (f"; failed: {'; '.join(failed)}" if failed else ""))


# what a create may meet that passes by itself: a full cluster, a host's transient failure
# (a shell that did not start, a host restarting), an image another create is still pulling
TRANSIENT_CREATE_ERRORS = (NoSandboxCapacity, ImageUnavailable)


def _transient(exc: SandboxError | ImageError) -> bool:
    return isinstance(exc, TRANSIENT_CREATE_ERRORS) or type(exc) is SandboxError


def open_sandbox_waiting(client: redis.Redis, spec: SandboxSpec, job_id: str, *,
                         budget_s: float, check: Any = None, lease_s: float | None = None,
                         first_pause_s: float = 0.1, max_pause_s: float = 2.0,
                         keeper: SandboxHandle | None = None) -> tuple[RemoteSandbox, float]:
    """:func:`open_sandbox`, waiting out what is not the job's fault instead of failing it:
    retried with backoff (jittered, so a thousand waiting inits do not knock at once) for at
    most ``budget_s`` and ``settings.sandbox_create_wait_s``. ``check()`` runs before each try
    and raises to stop (a cancelled job). Returns the sandbox and the seconds waited before the
    try that succeeded; the last error is raised once the wait is spent, a permanent one
    (policy, image not found, bad request) at once."""
    from config.settings import get_settings

    started = time.monotonic()
    deadline = started + min(budget_s, get_settings().sandbox_create_wait_s)
    backoff, retry = Backoff(first_pause_s, max_pause_s, jitter=(0.5, 1.0)), 0
    while True:
        if check is not None:
            check()
        waited = time.monotonic() - started  # before this try: the create's own time is not waiting
        try:
            return open_sandbox(client, spec, job_id, lease_s, keeper), waited
        except (SandboxError, ImageError) as exc:
            retry += 1
            if not _transient(exc) or time.monotonic() + backoff.base(retry) > deadline:
                raise
            (log.warning if waited < 10 <= waited + backoff.base(retry) else log.info)(
                "job %s waited %.1f s for a sandbox so far: %s", job_id, waited + backoff.base(retry), exc)
        wait(backoff.pause(retry))


class HostProvider:
    """The ``hosts`` provider (:mod:`sandboxes.provider`): our sandbox hosts, placed on by their
    heartbeats in the job store's Redis, driven over HTTP by handle."""

    def __init__(self, client: redis.Redis):
        self.redis = client

    def open(self, spec: SandboxSpec, job_id: str, *, budget_s: float,
             check: Any = None, keeper: Any = None) -> tuple[RemoteSandbox, float]:
        return open_sandbox_waiting(self.redis, spec, job_id, budget_s=budget_s, check=check,
                                    keeper=keeper.handle if keeper is not None else None)

    def attach(self, handle: dict[str, Any]) -> RemoteSandbox:
        return RemoteSandbox(SandboxHandle.model_validate(handle))

    def close(self, handle: SandboxHandle | dict[str, Any]) -> bool:
        return close_handle(handle)

    def close_measured(self, handle: SandboxHandle | dict[str, Any]) -> tuple[bool, SandboxUsage | None]:
        return close_measured(handle)

    def gateway_route(self, sandbox: Any, socket_path: str, listen: Any, key: str | None = None) -> GatewayRoute:
        return gateway_route(sandbox, socket_path, listen, key)

    def close_gateway_route(self, sandbox: Any, socket_path: str) -> None:
        close_gateway_route(sandbox, socket_path)
