"""The sandbox half of the beat sweep: reconcile sandboxes with jobs, and hosts with heartbeats.

- A host whose heartbeat stopped (3 x ``host_heartbeat_s``) is dead: it leaves ``keys.hosts()``,
  and every active job whose sandbox lived there runs again from init on another host
  (:mod:`tasks.retry`, fault ``sandbox_host_lost``), or ends ``failed`` with
  ``critical_error="sandbox"`` once its attempts are used up.
- Every live host is asked for its sandboxes; one is closed when its job is terminal or unknown,
  or (after a grace of one stage lease, which covers a sandbox whose init has not yet recorded
  it) when its job points at another sandbox (neither its own nor one it holds beside it: ``aux``)
  or its lease is long past.
- A sandbox whose job waits between two stages (its last stage done or re-sent, the next not yet
  taken by a worker) has its lease renewed when it would lapse before the next pass but one: the
  host kills a sandbox unused for ``sandbox_lease_s``, and under bulk load a job can wait for a run
  or eval worker longer than that (15 of 196 jobs of a Harbor set lost their sandbox so and ran
  again from init). A running stage renews its own; a holder that died is the stage lease's
  matter (the sweep re-sends the stage), so only the waiting are kept alive from here.
- Every live host is asked for its node's strays, what a runtime runs outside any host
  (Apptainer's instances: :meth:`~sandboxes.base.SandboxRuntime.strays`); those whose job is
  terminal or unknown are stopped by that host. The sweep imports no runtime: the node it runs
  on may have none, and every node's strays are found, not only its own.
- Every host reached is asked for its node's frozen layers (:mod:`tasks.sweep.layers`); those
  whose group ended or whose TTL passed are removed by that host.
"""
from __future__ import annotations

import logging
import time

from config.settings import get_settings
from prorl_celery import keys
from prorl_celery.errors import NotFound, SandboxError
from prorl_celery.jobs import JobRecord, JobStore
from prorl_celery.redisio import text
from prorl_celery.status import STAGES, StageState
from sandboxes.client import (RemoteSandbox, close_handle, handle_of, list_sandboxes, list_strays, live_hosts,
                              stop_strays)
from sandboxes.protocol import HostRecord, SandboxEntry
from tasks.sweep.layers import sweep_layers

log = logging.getLogger(__name__)


# Atomic, so that a host beating again between the read and the removal is not declared dead.
_TAKE_STALE = """
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1])
if #dead > 0 then redis.call('ZREM', KEYS[1], unpack(dead)) end
return dead
"""


def mark_dead_hosts(store: JobStore, now: float) -> list[str]:
    """Remove hosts whose heartbeat stopped from the live set; returns their ids."""
    cutoff = now - 3 * get_settings().host_heartbeat_s
    return [text(h) for h in store.redis.eval(_TAKE_STALE, 1, keys.hosts(), repr(cutoff))]


def fail_jobs_on(store: JobStore, host_ids: list[str]) -> list[str]:
    """Retry from init (or, out of attempts, end) every active job whose sandbox was on one of
    ``host_ids``; returns their ids."""
    from tasks.retry import HOST_LOST, Requeued, retry_from_init

    if not host_ids:
        return []
    ids = [job_id for status in STAGES for job_id in store.ids_in(status)]
    ended = []
    for record in store.get_many(ids):
        if record is None or record.status.terminal or not record.sandbox:
            continue
        host_id = record.sandbox.get("host_id")
        if host_id not in host_ids:
            continue
        message = f"sandbox host {host_id} stopped heart-beating; its sandboxes are gone"
        out = retry_from_init(store, record, HOST_LOST, message)
        if isinstance(out, Requeued):
            out.send()  # a stage still running on a live worker lets go at its next check
        if out is not None:
            ended.append(record.job_id)
    return ended


def doomed(entry: SandboxEntry, record: JobRecord | None, now: float, grace_s: float) -> str | None:
    """Why a host's sandbox should be closed, or None to keep it."""
    if record is None:
        return "its job is unknown"
    if record.status.terminal:
        return f"its job is {record.status.value}"
    if now - entry.created_at < grace_s:
        return None
    held = [record.sandbox.get("sandbox_id"), *record.sandbox.get("aux", [])] if record.sandbox else []
    if entry.sandbox_id not in held and (entry.keeper is None or entry.keeper not in held):
        return "its job uses another sandbox"  # held: its own, a grader's (aux), a sidecar its keeper's
    if now > entry.expires_at + grace_s:
        return "its lease is long past"
    return None


WAITING = (StageState.DONE, StageState.REDISPATCHED)  # a stage finished or re-sent: the next not taken yet


def lapses_while_waiting(entry: SandboxEntry, record: JobRecord | None, now: float) -> bool:
    """Whether ``entry`` (a sandbox its job holds) lapses before the pass after next while its job
    waits for a worker to take its next stage."""
    if record is None or record.status.terminal or record.stage_state not in WAITING:
        return False
    return entry.expires_at - now < 2.5 * get_settings().sweep_interval_s


def _renew(host: HostRecord, entry: SandboxEntry) -> bool:
    try:
        RemoteSandbox(handle_of(host, entry)).renew()
        return True
    except SandboxError as exc:  # gone meanwhile: the next stage finds out and runs it again
        log.info("sweep could not renew sandbox %s of job %s: %s", entry.sandbox_id, entry.job_id, exc)
        return False


def close_orphans(store: JobStore, host: HostRecord, now: float, grace_s: float,
                  renewed: list[str] | None = None) -> list[str]:
    """Close ``host``'s sandboxes that are :func:`doomed`, renew those whose job waits between
    stages (their ids added to ``renewed``); returns the ids closed."""
    entries = list_sandboxes(host.address, host.token)
    records = store.get_many([entry.job_id for entry in entries], light=True) if entries else []
    closed = []
    for entry, record in zip(entries, records):
        why = doomed(entry, record, now, grace_s)
        if why is None:
            if lapses_while_waiting(entry, record, now) and _renew(host, entry) and renewed is not None:
                renewed.append(f"{host.host_id}/{entry.sandbox_id}")
            continue
        log.info("sweep closes sandbox %s on %s (job %s): %s", entry.sandbox_id, host.host_id,
                 entry.job_id, why)
        if close_handle(handle_of(host, entry), raise_errors=True):  # unreachable: sweep_sandboxes reports the host
            closed.append(f"{host.host_id}/{entry.sandbox_id}")
    return closed


def stop_orphan_strays(store: JobStore, host: HostRecord, seen: set[str]) -> list[str]:
    """Ask ``host`` for its node's strays and have it stop those whose job is terminal or
    unknown; ``seen``: names already handled this pass (hosts sharing a node list the same)."""
    strays = [stray for stray in list_strays(host.address, host.token) if stray.name not in seen]
    seen.update(stray.name for stray in strays)
    statuses = [store.status(stray.job_id) for stray in strays]
    doomed = [stray for stray, status in zip(strays, statuses) if status is None or status.terminal]
    if not doomed:
        return []
    answer = stop_strays(host.address, host.token, doomed)
    for name, why in answer.failed.items():
        log.warning("sandbox host %s could not stop stray %s: %s", host.host_id, name, why)
    return answer.stopped


def sweep_sandboxes(store: JobStore, now: float | None = None) -> dict[str, list]:
    """One pass; returns ``{hosts_dead, jobs_host_lost, sandboxes_closed, sandboxes_renewed,
    hosts_unreachable, instances_stopped, layers_removed}`` (ids), also logged."""
    now = now or time.time()
    grace_s = get_settings().stage_lease_s
    dead = mark_dead_hosts(store, now)
    report: dict[str, list] = {"hosts_dead": dead, "jobs_host_lost": fail_jobs_on(store, dead),
                               "sandboxes_closed": [], "sandboxes_renewed": [], "hosts_unreachable": [],
                               "instances_stopped": []}
    seen: set[str] = set()
    reached = []
    for host in live_hosts(store.redis):
        try:
            report["sandboxes_closed"] += close_orphans(store, host, now, grace_s, report["sandboxes_renewed"])
        except SandboxError as exc:
            log.warning("sweep could not reach sandbox host %s: %s", host.host_id, exc)
            report["hosts_unreachable"].append(host.host_id)
            continue
        reached.append(host)
        try:
            report["instances_stopped"] += stop_orphan_strays(store, host, seen)
        except (SandboxError, NotFound) as exc:  # NotFound: a host of an older version
            log.warning("sweep could not have the strays of sandbox host %s stopped: %s", host.host_id, exc)
    report["layers_removed"] = sweep_layers(store, reached, now)
    for action, ids in report.items():
        if ids:
            log.warning("sandbox sweep %s %d: %s", action, len(ids), ids)
    return report
