"""What this host's node runs outside any host: each served runtime's strays
(:meth:`~sandboxes.base.SandboxRuntime.strays`, Apptainer's instances), listed for the beat
sweep, which decides by their jobs which to stop and asks this host to stop them. The sweep
itself imports no runtime: it may run on a node without one."""
from __future__ import annotations

import logging

from prorl_celery.errors import ProrlError
from sandboxes.host.pool import SandboxPool
from sandboxes.protocol import StopStraysResponse, Stray
from sandboxes.registry import load_runtime

log = logging.getLogger(__name__)


def list_strays(pool: SandboxPool) -> list[Stray]:
    """Every served runtime's strays, named by the runtime as this host serves it."""
    return [stray.model_copy(update={"runtime": name}) for name in pool.served.names
            for stray in load_runtime(name).strays(pool.runtime_config.get(name))]


def stop_strays(pool: SandboxPool, strays: list[Stray]) -> StopStraysResponse:
    """Stop each of ``strays`` by its runtime's hook; a runtime this host does not serve, or a
    stop that fails, is reported per name and does not stop the others."""
    answer = StopStraysResponse(stopped=[])
    for stray in strays:
        if stray.runtime not in pool.served.names:
            answer.failed[stray.name] = f"runtime {stray.runtime!r} is not served by this host"
            continue
        try:
            load_runtime(stray.runtime).stop_stray(stray.name, pool.runtime_config.get(stray.runtime))
        except (ProrlError, OSError, NotImplementedError) as exc:
            log.warning("could not stop stray %s (%s): %s", stray.name, stray.runtime, exc)
            answer.failed[stray.name] = f"{type(exc).__name__}: {exc}"
        else:
            answer.stopped.append(stray.name)
    return answer
