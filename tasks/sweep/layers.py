"""The frozen-layer half of the beat sweep: each live host is asked for its node's layers
(:mod:`sandboxes.runtimes.layers`: a Harbor group's prepared root, :mod:`tasks.harbor.fork`), and
has those removed whose group ended (every job of it terminal, or the group unknown) or whose
age passed ``harbor_fork_ttl_s``; the host never removes one a live sandbox holds. The layer's
Redis record goes first, so no job of its group starts on a layer being removed."""
from __future__ import annotations

import logging

from config.settings import get_settings
from prorl_celery import keys
from prorl_celery.errors import NotFound, SandboxError
from prorl_celery.jobs import JobStore
from prorl_celery.status import JobStatus
from sandboxes.client import list_layers, remove_layers
from sandboxes.protocol import HostRecord, LayerEntry

log = logging.getLogger(__name__)


def layer_doomed(layer: LayerEntry, statuses: list[JobStatus | None], now: float, ttl_s: float) -> str | None:
    """Why ``layer`` should go (``statuses``: its group's jobs'), or None to keep it."""
    if layer.in_use:
        return None
    if now - layer.created_at > ttl_s:
        return f"older than harbor_fork_ttl_s ({ttl_s:.0f} s)"
    if not layer.group_id:
        return "it serves no group"
    if not statuses:
        return "its group is unknown"
    if all(status is None or status.terminal for status in statuses):
        return "its group ended"
    return None


def sweep_layers(store: JobStore, hosts: list[HostRecord], now: float) -> list[str]:
    """One pass over ``hosts``; returns the layers removed (hosts sharing a node list the same:
    each layer is judged once)."""
    ttl_s, seen, removed = get_settings().harbor_fork_ttl_s, set(), []
    for host in hosts:
        try:
            layers = [layer for layer in list_layers(host.address, host.token) if layer.name not in seen]
        except (SandboxError, NotFound) as exc:  # NotFound: a host of an older version
            log.warning("sweep could not list the layers of sandbox host %s: %s", host.host_id, exc)
            continue
        seen.update(layer.name for layer in layers)
        doomed = []
        for layer in layers:
            group = store.group_ids(layer.group_id) if layer.group_id else []
            why = layer_doomed(layer, store.statuses(group), now, ttl_s)
            if why:
                log.info("sweep removes layer %s (group %s): %s", layer.name, layer.group_id, why)
                doomed.append(layer.name)
        if doomed:
            store.redis.delete(*[keys.fork_layer(name) for name in doomed])
            removed += remove_layers(host.address, host.token, doomed)
    return removed
