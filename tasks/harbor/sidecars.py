"""A Harbor task's sidecar services (``environment/docker-compose.yaml``, :mod:`tasks.harbor.compose`)
run beside the agent's sandbox, each in a sandbox of its own.

A sidecar is the task author's code, not the model's: it runs in its own sandbox of its own
image (built from its build context as the task's is), with the network a build gets (the
operator's ``harbor_sidecar_network``: an MCP server that fetches its packages at start needs the
registries), on the agent's host, kept by the agent's sandbox (its host holds its lease while the
agent's lives and closes it with the agent's: nothing to close here, nothing for the sweep to
leak). The agent reaches it only through a forward of its ports into the agent's own network
namespace (:mod:`sandboxes.host.forward`: ``127.0.0.1:PORT`` there, spliced to the sidecar's own
``127.0.0.1:PORT``), with ``/etc/hosts`` naming every service 127.0.0.1; an offline agent stays
offline: it gets no route out through the sidecar's interface. Sidecars reach each other the same
way. Services start in ``depends_on`` order, each after the conditions it waits for hold
(service_started, service_healthy with Docker's healthcheck polling, service_completed_successfully);
the agent's sandbox runs nothing of the task (its entrypoint, a step's setup, the agent) before
``main``'s conditions hold. A sidecar that exits or never gets healthy is :class:`SidecarFailed`
naming it. The verifier's fresh sandbox runs without them (the tests read the task's files).
"""
from __future__ import annotations

import shlex
import time
from typing import Any

from config.settings import get_settings
from prorl_celery.errors import InvalidRequest, SidecarFailed
from sandboxes.base import SandboxSpec
from tasks.context import StageContext
from tasks.harbor import boxes
from tasks.harbor.compose import Compose, Health, Sidecar, duration
from tasks.harbor.task import HarborTask

EXITED = "/logs/.prorl-service-exit"
LOG = "/logs/service.log"


def build(ctx: StageContext, task: HarborTask, sidecar: Sidecar) -> dict[str, Any]:
    """The sidecar's image, built (or found built) now; the wait is not charged to the stage."""
    from sandboxes.runtimes.images.build import ensure_built

    started = time.monotonic()
    if sidecar.context is not None:
        context = (task.environment / sidecar.context).resolve()
        if not context.is_relative_to(task.environment.resolve()) or not context.is_dir():
            raise InvalidRequest(f"task {task.name}: service {sidecar.name}'s build context {sidecar.context!r} is not "
                                 "a directory beneath environment/", field=f"compose.services.{sidecar.name}.build")
        dockerfile = context / (sidecar.dockerfile or "Dockerfile")
    else:
        context, dockerfile = boxes.from_only(sidecar.image), None
    built = ensure_built(context, dockerfile, build_args=sidecar.args, timeout_s=task.config.environment.build_timeout_sec)
    waited = time.monotonic() - started
    ctx.deadline += waited
    ctx.state.init_wait_s = round((ctx.state.init_wait_s or 0.0) + waited, 3)
    return {"rootfs": built.rootfs, "key": built.key, "env": built.env, "from": built.from_ref, "base": built.base, "notes": built.notes,
            "workdir": built.workdir, "entrypoint": built.config.entrypoint, "cmd": built.config.cmd,
            "expose": built.config.expose, "healthcheck": built.config.healthcheck, "build_s": round(waited, 3)}


def argv(sidecar: Sidecar, image: dict[str, Any]) -> list[str]:
    """What the service runs, by Docker's rules: the file's entrypoint drops the image's CMD."""
    entry = sidecar.entrypoint if sidecar.entrypoint is not None else (image.get("entrypoint") or [])
    cmd = sidecar.command if sidecar.command is not None else \
        ([] if sidecar.entrypoint is not None else image.get("cmd") or [])
    return [*entry, *cmd]


def image_health(check: dict[str, Any] | None) -> Health | None:
    """The image's own HEALTHCHECK (when the compose file gives none), as the file's would be."""
    if not check:
        return None
    test = check.get("test")
    if isinstance(test, str):
        kind, _, rest = test.strip().partition(" ")
        if kind.upper() == "NONE":
            return None
        command = f"/bin/sh -c {shlex.quote(rest if kind.upper() == 'CMD' else test)}"
    else:
        command = shlex.join(test or [])
    fail = lambda where, why: InvalidRequest(f"HEALTHCHECK {where} {why}", field="HEALTHCHECK")  # noqa: E731
    d = lambda key, default: duration(check.get(key), default, key, fail)  # noqa: E731
    return Health(command=command, interval_s=d("interval", 30.0), timeout_s=d("timeout", 30.0),
                  retries=int(check.get("retries") or 3), start_period_s=d("start-period", 0.0),
                  start_interval_s=d("start-interval", 5.0))


def _spec(ctx: StageContext, handler: Any, sidecar: Sidecar, image: dict[str, Any]) -> SandboxSpec:
    base = handler.sandbox_spec({"data_source": "harbor"})  # the domain's defaults, not the agent's block
    network = get_settings().harbor_sidecar_network  # the registries' clients get the node's trust store
    return base.model_copy(update={
        "image": image["rootfs"], "writable_root": True, "workdir": sidecar.workdir or image.get("workdir") or "/",
        "network": network, "env": {**(boxes.tools_env(image) if network else {}), **sidecar.env}})


def hosts(box: Any, names: list[str]) -> None:
    """``/etc/hosts`` naming every service 127.0.0.1 (and localhost, if the image's names none)."""
    line = shlex.quote(f"127.0.0.1\t{' '.join(names)}\n")
    box.exec("grep -qsw localhost /etc/hosts || printf '127.0.0.1\\tlocalhost\\n::1\\tlocalhost\\n' >> /etc/hosts; "
             f"printf %s {line} >> /etc/hosts", timeout=30)


class Services:
    """The task's sidecars as they start: their sandboxes, ports and what each waited for."""

    def __init__(self, ctx: StageContext, handler: Any, task: HarborTask, agent: Any):
        self.ctx, self.handler, self.task, self.agent = ctx, handler, task, agent
        self.compose: Compose = task.compose
        self.boxes: dict[str, Any] = {}
        self.record: dict[str, dict[str, Any]] = {}
        self.ready: set[str] = set()
        self._health: dict[str, Health | None] = {}
        self.names = [s.name for s in self.compose.sidecars]

    def start(self) -> dict[str, dict[str, Any]]:
        hosts(self.agent, self.names)
        images = {s.name: build(self.ctx, self.task, s) for s in self.compose.sidecars}
        taken = {p: s.name for s in self.compose.sidecars for p in s.ports}
        for sidecar in self.compose.sidecars:
            self._wait(sidecar.name, sidecar.depends_on)
            self._open(sidecar, images[sidecar.name], taken)
        self._wait("main", self.compose.main_depends_on)
        return self.record

    def _open(self, sidecar: Sidecar, image: dict[str, Any], taken: dict[int, str]) -> None:
        ports = list(sidecar.ports)
        for text in image.get("expose") or []:  # the image's EXPOSE, where no other service has the port
            port = text.split("/")[0]
            if port.isdigit() and taken.setdefault(int(port), sidecar.name) == sidecar.name and int(port) not in ports:
                ports.append(int(port))
        command = argv(sidecar, image)
        if not command:
            raise InvalidRequest(f"task {self.task.name}: service {sidecar.name} has no command, entrypoint or CMD",
                                 field=f"{self.compose.file}.services.{sidecar.name}.command")
        started = time.monotonic()
        box = self.ctx.open_kept_sandbox(_spec(self.ctx, self.handler, sidecar, image), self.agent)
        hosts(box, self.names)
        for name, other in self.boxes.items():  # every service reaches every other by name
            if self.record[name]["ports"]:
                box.forward(other.handle.sandbox_id, self.record[name]["ports"])
            if ports:
                other.forward(box.handle.sandbox_id, ports)
        if ports:
            self.agent.forward(box.handle.sandbox_id, ports)
        box.exec(f"mkdir -p /logs && rm -f {EXITED} && (setsid /bin/sh -c {shlex.quote(shlex.join(command) + f'; echo $? > {EXITED}')}"
                 f" </dev/null >{LOG} 2>&1 &)", timeout=30)
        self.boxes[sidecar.name] = box
        self.record[sidecar.name] = {
            "sandbox_id": box.handle.sandbox_id, "command": command, "ports": ports,
            "network": get_settings().harbor_sidecar_network, "started_s": round(time.monotonic() - started, 3),
            "image": {k: image[k] for k in ("key", "from", "base", "notes", "build_s")}}
        self._health[sidecar.name] = check = sidecar.health or image_health(image.get("healthcheck"))
        self.record[sidecar.name]["healthcheck"] = check.command if check else None

    def _wait(self, owner: str, deps: dict[str, str]) -> None:
        for name, condition in deps.items():
            key = f"{name}:{condition}"
            self.record[name].setdefault("waited_for_by", []).append(owner)
            if key in self.ready or condition == "service_started":
                continue
            began = time.monotonic()
            why = self._healthy(name) if condition == "service_healthy" else self._completed(name)
            if why:
                raise SidecarFailed(f"task {self.task.name}: service {name} ({condition}, which {owner} waits for): "
                                    f"{why}; its output's end: {self._tail(name)}")
            self.ready.add(key)
            self.record[name]["ready_s" if condition == "service_healthy" else "completed_s"] = \
                round(time.monotonic() - began + self.record[name]["started_s"], 3)

    def _exit(self, name: str) -> str | None:
        out = self.boxes[name].exec(f"cat {EXITED} 2>/dev/null", timeout=30)
        text = out.output.strip()
        return text if out.exit_code == 0 and text else None

    def _healthy(self, name: str) -> str | None:
        check = self._health.get(name)
        if check is None:
            return "it has no healthcheck (none in the compose file, no HEALTHCHECK in its image)"
        ended = lambda: (f"it exited (status {code}) before it was healthy"  # noqa: E731
                         if (code := self._exit(name)) is not None else None)
        return boxes.poll(self.ctx, self.boxes[name], check.command, interval_s=check.interval_s,
                          timeout_s=check.timeout_s, retries=check.retries, start_period_s=check.start_period_s,
                          start_interval_s=check.start_interval_s, ended=ended)

    def _completed(self, name: str) -> str | None:
        while (code := self._exit(name)) is None:
            self.ctx.check()
            time.sleep(1.0)
        return None if code == "0" else f"it exited with status {code}"

    def _tail(self, name: str) -> str:
        try:
            return self.boxes[name].exec(f"tail -c 1500 {LOG}", timeout=30).output
        except Exception as exc:  # noqa: BLE001 - the fault is the service's; its log is a courtesy
            return f"(its log could not be read: {exc})"


def start(ctx: StageContext, handler: Any, task: HarborTask, agent: Any) -> dict[str, dict[str, Any]]:
    """Every sidecar of ``task`` started beside ``agent`` (see the module doc); what ran, and how."""
    return Services(ctx, handler, task, agent).start()
