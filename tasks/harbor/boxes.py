"""What a Harbor task's sandboxes get around the agent and the verifier: the node's verifier
toolkit, a docker_image as a build context, the image's ENTRYPOINT, artifacts taken out, the
healthcheck's polling, the agent's timeout as a harness's wall time, a lease kept while a step is
graded, the harness class of an instance."""
from __future__ import annotations

import shlex
import threading
import time
from typing import Any

from tasks.context import StageContext
from tasks.harbor import files
from tasks.harbor.task import Step


def tools_env(image: dict[str, Any]) -> dict[str, str]:
    """The verifier's variables for the node's toolkit (uv, its installer served offline), built
    here once per node: PATH with it first, its trust store for the registries' clients."""
    from sandboxes.runtimes.images import verifier_tools

    path = (image.get("env") or {}).get("PATH") or "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return verifier_tools.sandbox_env(verifier_tools.ensure_tools(), path)


def from_only(ref: str | None):
    """A build context whose Dockerfile is ``FROM ref`` ([environment] docker_image without a Dockerfile)."""
    import hashlib

    from sandboxes.runtimes.images.build import build_dir

    context = build_dir() / "from-only" / hashlib.sha256(str(ref).encode()).hexdigest()[:24]
    context.mkdir(parents=True, exist_ok=True)
    dockerfile = context / "Dockerfile"
    if not dockerfile.is_file():
        dockerfile.write_text(f"FROM {ref}\n")
    return context


def entrypoint(box: Any, image: dict[str, Any]) -> None:
    """The image's ENTRYPOINT started as a container's is under Harbor (its command ``sh -c
    'sleep infinity'``), in the background; its output in /logs/entrypoint.log."""
    entry = image.get("entrypoint")
    if not entry:
        return
    argv = " ".join(shlex.quote(a) for a in [*entry, "sh", "-c", "sleep infinity"])
    box.exec(f"mkdir -p /logs; (setsid {argv} </dev/null >/logs/entrypoint.log 2>&1 &) ; sleep 0.5", timeout=30)


def setup(ctx: StageContext, box: Any, step: Step, workdir: str) -> None:
    """The step's ``workdir/`` put in ``workdir``, then its ``setup.sh`` run there (and removed)."""
    if step.workdir_files is None:
        return
    files.put_dirs(box, [step.workdir_files], workdir, mount=files.mount_of(box))
    if (step.workdir_files / "setup.sh").is_file():
        out = box.exec(f"cd {shlex.quote(workdir)} && bash ./setup.sh; rc=$?; rm -f ./setup.sh; exit $rc",
                       timeout=max(1.0, min(600.0, ctx.remaining())))
        if out.exit_code != 0:
            raise RuntimeError(f"step {step.name}: workdir/setup.sh failed (exit {out.exit_code}): "
                               f"{out.output[-1000:]}")


def artifacts(box: Any, step: Step) -> dict[str, Any]:
    sources = [a.source for a in step.artifacts if a.source.startswith("/")]
    if not sources:
        return {}
    try:
        return files.members(box.export_tree(sources, 16 * 1024 * 1024), files.TEXT_LIMIT)
    except Exception as exc:  # noqa: BLE001 - an artifact missing is no fault of the grade
        return {"error": str(exc)[:300]}


class kept:
    """The sandbox's lease renewed every 20 s while the block runs (the host kills one unused
    for ``sandbox_lease_s``)."""

    def __init__(self, box: Any):
        self.box, self.stop = box, threading.Event()
        self.thread = threading.Thread(target=self._renew, name="harbor-keep", daemon=True)

    def _renew(self) -> None:
        while not self.stop.wait(20.0):
            try:
                self.box.renew()
            except Exception:  # noqa: BLE001 - a lapsed lease shows when the sandbox is used next
                return

    def __enter__(self) -> None:
        self.thread.start()

    def __exit__(self, *exc: object) -> None:
        self.stop.set()


def harness_class(instance: dict[str, Any]):
    from tasks.harnesses import HARNESSES, is_harness_agent

    return HARNESSES.load(instance["agent"]["harness"]) if is_harness_agent(instance) else None


class wall:
    """The step's ``[agent] timeout_sec`` as the harness's wall time while it runs."""

    def __init__(self, ctx: StageContext, step: Step):
        self.agent = ctx.instance.get("agent") if isinstance(ctx.instance.get("agent"), dict) else None
        self.limit = step.agent_timeout_s
        self.before = self.agent.get("wall_s") if self.agent else None

    def __enter__(self) -> None:
        if self.agent is not None and self.limit:
            self.agent["wall_s"] = min(self.limit, self.before or self.limit)

    def __exit__(self, *exc: object) -> None:
        if self.agent is not None and self.limit:
            if self.before is None:
                self.agent.pop("wall_s", None)
            else:
                self.agent["wall_s"] = self.before


def healthcheck(ctx: StageContext, box: Any, step: Step) -> None:
    """The step's healthcheck polled (:func:`poll`); unhealthy is an init fault."""
    check = step.healthcheck
    why = poll(ctx, box, check.command, interval_s=check.interval_sec, timeout_s=check.timeout_sec,
               retries=check.retries, start_period_s=check.start_period_sec, start_interval_s=check.start_interval_sec)
    if why:
        raise RuntimeError(f"step {step.name}: {why}")


def poll(ctx: StageContext, box: Any, command: str, *, interval_s: float, timeout_s: float, retries: int,
         start_period_s: float, start_interval_s: float, ended: Any = None) -> str | None:
    """Docker HEALTHCHECK's polling of ``command`` in ``box``: None (healthy) at the first
    success; why not after ``retries`` failures in a row past the start period (failures within
    it do not count), or as soon as ``ended()`` says why the service is gone."""
    started, failures = time.monotonic(), 0
    while True:
        out = box.exec(command, timeout=timeout_s)
        if out.exit_code == 0:
            return None
        gone = ended() if ended is not None else None
        if gone:
            return gone
        in_start = time.monotonic() - started < start_period_s
        failures += 0 if in_start else 1
        if failures >= retries:
            return f"healthcheck {command!r} failed {failures} times: {out.output[-500:]}"
        ctx.check()
        time.sleep(start_interval_s if in_start else interval_s)
