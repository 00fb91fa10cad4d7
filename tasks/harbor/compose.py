"""A Harbor task's ``environment/docker-compose.yaml``: the subset the field uses, honoured or refused.

Harbor merges the task's compose file over its own base, whose service ``main`` is the task's
Dockerfile image: the file may add to ``main`` only ``depends_on`` and ``environment``, and adds
services (sidecars: an API server, an MCP server) that run here in sandboxes of their own
(:mod:`tasks.harbor.sidecars`). A service may have ``build`` (context, dockerfile, args) or
``image``, ``environment`` (list or map), ``command``, ``entrypoint``, ``working_dir``,
``expose``, ``ports`` (the container's port, as an exposure: nothing is published on a node),
``healthcheck`` (CMD, CMD-SHELL, NONE; interval, timeout, retries, start_period, start_interval)
and ``depends_on`` (list, or map with service_started / service_healthy /
service_completed_successfully). ``x-`` extension keys carry YAML anchors and mean nothing.
Every other key (volumes, privileged, network_mode, cap_add, devices ...) is refused by name.

Interpolation as compose does it (``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
``${VAR:?error}``, ``${VAR:+alt}``, ``$$``), from the worker's environment but only for the names
the operator lists in ``harbor_compose_env`` (``PRORL_HARBOR_COMPOSE_ENV``): any other name is
unset (its default, or ""). An ``environment`` or build ``args`` entry that names a variable with
no value (``- DAYTONA_API_KEY``, ``KEY:``) takes the worker's, as compose takes the shell's, from
those names alone; any other is left out (a list entry) or empty (a map's).
"""
from __future__ import annotations

import os
import re
import shlex
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from prorl_celery.errors import InvalidRequest

FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
MAIN = "main"
MAX_SERVICES = 8
Condition = Literal["service_started", "service_healthy", "service_completed_successfully"]
_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,62}$")
_VAR = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])((?:[^{}]|\{[^{}]*\})*))?\}|([A-Za-z_][A-Za-z0-9_]*))")
_TYPE_TAG = re.compile(r"^([A-Z]\w*|str|int|float|bool|none|.*\[.*)$")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")
_UNIT_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
WHY = {"volumes": "no volume is shared between sandboxes here",
       "network_mode": "every service reaches the others by name on 127.0.0.1; no other network is made",
       "networks": "every service reaches the others by name on 127.0.0.1; no other network is made",
       "privileged": "sandboxes run without capabilities", "cap_add": "sandboxes run without capabilities",
       "devices": "no device reaches a sandbox", "user": "sandboxes run their commands as root"}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Build(_Model):
    context: str = "."
    dockerfile: str | None = None
    args: dict[str, str | int | float | None] | list[str] = {}


class Healthcheck(_Model):
    test: list[str] | str | None = None
    interval: str | float | None = None
    timeout: str | float | None = None
    retries: int | None = Field(None, ge=1)
    start_period: str | float | None = None
    start_interval: str | float | None = None
    disable: bool = False


class Dependency(_Model):
    condition: Condition = "service_started"
    required: bool = True


class Port(_Model):
    target: int
    published: str | int | None = None
    protocol: str = "tcp"
    host_ip: str | None = None
    mode: str | None = None
    name: str | None = None
    app_protocol: str | None = None


Scalar = str | int | float | bool | None


class Service(_Model):
    build: str | Build | None = None
    image: str | None = None
    environment: dict[str, Scalar] | list[str] = {}
    command: str | list[str] | None = None
    entrypoint: str | list[str] | None = None
    working_dir: str | None = None
    expose: list[str | int] = []
    ports: list[str | int | Port] = []
    healthcheck: Healthcheck | None = None
    depends_on: list[str] | dict[str, Dependency] = {}


class MainOverride(_Model):
    environment: dict[str, Scalar] | list[str] = {}
    depends_on: list[str] | dict[str, Dependency] = {}


class ComposeFile(_Model):
    services: dict[str, dict[str, Any]]
    version: str | float | None = None
    name: str | None = None


class Health(BaseModel):
    """A healthcheck as Docker polls it (durations in seconds, Docker's defaults)."""

    command: str  # run by the sandbox's shell
    interval_s: float = 30.0
    timeout_s: float = 30.0
    retries: int = 3
    start_period_s: float = 0.0
    start_interval_s: float = 5.0


class Sidecar(BaseModel):
    """One service besides ``main``, as it is built and run."""

    name: str
    context: str | None = None  # a directory beneath environment/ (build), or None (image)
    dockerfile: str | None = None
    args: dict[str, str] = {}
    image: str | None = None
    env: dict[str, str] = {}
    command: list[str] | None = None
    entrypoint: list[str] | None = None
    workdir: str | None = None
    ports: list[int] = []
    health: Health | None = None
    health_disabled: bool = False
    depends_on: dict[str, str] = {}  # service -> condition


class Compose(BaseModel):
    """The file as honoured: the sidecars in start order, what ``main`` adds."""

    file: str
    sidecars: list[Sidecar]
    main_env: dict[str, str] = {}
    main_depends_on: dict[str, str] = {}

    def by_name(self) -> dict[str, Sidecar]:
        return {s.name: s for s in self.sidecars}


# -- interpolation -----------------------------------------------------------------------------
def allowed_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The worker's variables a compose file may read: those ``harbor_compose_env`` names."""
    from config.settings import get_settings

    environ = os.environ if environ is None else environ
    names = [n.strip() for n in get_settings().harbor_compose_env.split(",") if n.strip()]
    return {n: environ[n] for n in names if n in environ}


def interpolate(value: Any, env: Mapping[str, str], where: str, fail) -> Any:
    """``value`` (a YAML tree) with every string's variables substituted from ``env``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env, f"{where}.{k}".lstrip("."), fail) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env, f"{where}.{i}", fail) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def one(match: re.Match) -> str:
        dollar, name, op, arg, bare = match.groups()
        if dollar:
            return "$"
        name = name or bare
        present, text = name in env, env.get(name, "")
        if op in (":-", "-"):
            return text if (present and (text or op == "-")) else interpolate(arg or "", env, where, fail)
        if op in (":+", "+"):
            return interpolate(arg or "", env, where, fail) if (present and (text or op == "+")) else ""
        if op in (":?", "?") and not (present and (text or op == "?")):
            raise fail(where, f"needs ${{{name}}} ({arg or 'required'}), which is unset or not among the "
                              "names the operator passes (PRORL_HARBOR_COMPOSE_ENV)")
        return text

    return _VAR.sub(one, value)


# -- parsing -----------------------------------------------------------------------------------
def duration(value: str | float | None, default: float, where: str, fail) -> float:
    if value is None:
        return default
    if isinstance(value, (int, float)):
        return float(value)
    text = value.strip()
    parts = _DURATION.findall(text)
    if not text or "".join(n + u for n, u in parts) != text:
        raise fail(where, f"{value!r} is not a duration such as '2s', '1m30s' or '500ms'")
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


def _argv(value: str | list[str] | None) -> list[str] | None:
    return None if value is None else (shlex.split(value) if isinstance(value, str) else list(value))


def _env(value: dict[str, Scalar] | list[str], scope: Mapping[str, str]) -> dict[str, str]:
    """``environment`` (or build ``args``) as a map; a name with no value takes ``scope``'s (the
    operator's names: :func:`allowed_env`), else is left out (list) or empty (map)."""
    if isinstance(value, list):
        pairs = [item.split("=", 1) for item in value]
        return {p[0]: p[1] if len(p) == 2 else scope[p[0]] for p in pairs if len(p) == 2 or p[0] in scope}
    return {k: (scope.get(k, "") if v is None else str(v).lower() if isinstance(v, bool) else str(v))
            for k, v in value.items()}


def _depends(value: list[str] | dict[str, Dependency]) -> dict[str, str]:
    return {n: "service_started" for n in value} if isinstance(value, list) else \
        {n: d.condition for n, d in value.items()}


def _port(item: str | int | Port, where: str, fail) -> int:
    if isinstance(item, Port):
        text, proto = str(item.target), item.protocol
    else:
        text, _, proto = str(item).partition("/")
        text = text.rsplit(":", 1)[-1]  # HOST_IP:PUBLISHED:TARGET -> TARGET
    if (proto or "tcp") != "tcp":
        raise fail(where, f"{item!r}: only TCP ports are reached here")
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise fail(where, f"{item!r} is not one port (ranges are not forwarded here)")
    return int(text)


def _health(check: Healthcheck, where: str, fail) -> Health | None:
    test = check.test
    if check.disable or test in (None, [], ["NONE"]):
        return None
    if isinstance(test, str):
        command = f"/bin/sh -c {shlex.quote(test)}"
    elif test[0] == "CMD" and len(test) > 1:
        command = shlex.join(test[1:])
    elif test[0] == "CMD-SHELL" and len(test) == 2:
        command = f"/bin/sh -c {shlex.quote(test[1])}"
    else:
        raise fail(f"{where}.test", f"{test!r}: give [\"CMD\", ...], [\"CMD-SHELL\", \"...\"] or [\"NONE\"]")
    d = lambda key, default: duration(getattr(check, key), default, f"{where}.{key}", fail)  # noqa: E731
    return Health(command=command, interval_s=d("interval", 30.0), timeout_s=d("timeout", 30.0),
                  retries=check.retries or 3, start_period_s=d("start_period", 0.0),
                  start_interval_s=d("start_interval", 5.0))


def _sidecar(name: str, svc: Service, where: str, fail, scope: Mapping[str, str]) -> Sidecar:
    if svc.build is None and not svc.image:
        raise fail(where, "has neither build nor image")
    build = Build(context=svc.build) if isinstance(svc.build, str) else svc.build
    context = None
    if build is not None:
        context = os.path.normpath(build.context)
        if os.path.isabs(context) or context.split(os.sep)[0] == "..":
            raise fail(f"{where}.build.context", f"{build.context!r} is not a directory beneath environment/")
    args = {} if build is None else _env(build.args, scope)
    ports = [_port(p, f"{where}.expose", fail) for p in svc.expose] + [_port(p, f"{where}.ports", fail) for p in svc.ports]
    health = _health(svc.healthcheck, f"{where}.healthcheck", fail) if svc.healthcheck else None
    return Sidecar(name=name, context=context, dockerfile=build.dockerfile if build else None, args=args,
                   image=svc.image if build is None else None, env=_env(svc.environment, scope),
                   command=_argv(svc.command), entrypoint=_argv(svc.entrypoint), workdir=svc.working_dir,
                   ports=list(dict.fromkeys(ports)), health=health,
                   health_disabled=bool(svc.healthcheck and svc.healthcheck.disable), depends_on=_depends(svc.depends_on))


def _validate(model: type[BaseModel], data: Any, where: str, fail, hint: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()  # a key of a union's model (build: {...}) over "should be a string"
        err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
        key = ".".join(str(p) for p in err["loc"] if not _TYPE_TAG.match(str(p)))  # not a union's member tags
        path = ".".join(p for p in (where, key) if p)
        if err["type"] == "extra_forbidden":
            top = str(err["loc"][0])
            nested = len([p for p in err["loc"] if not _TYPE_TAG.match(str(p))]) > 1
            why = f"not a key of {top} read here" if nested else WHY.get(top, hint)
            raise fail(path, f"is not honoured here: {why}") from None
        raise fail(path, err["msg"]) from None


def _order(sidecars: dict[str, Sidecar], fail) -> list[Sidecar]:
    done: list[str] = []

    def visit(name: str, trail: tuple[str, ...]) -> None:
        if name in done:
            return
        if name in trail:
            raise fail("services", f"depends_on makes a cycle: {' -> '.join((*trail, name))}")
        for dep in sidecars[name].depends_on:
            visit(dep, (*trail, name))
        done.append(name)

    for name in sidecars:
        visit(name, ())
    return [sidecars[n] for n in done]


def parse(text: str, task: str, file: str = "docker-compose.yaml", env: Mapping[str, str] | None = None) -> Compose:
    """The compose file ``text`` of task ``task`` honoured whole, or :class:`InvalidRequest`
    naming the key (``environment/<file>.services.X.key``) and the task."""
    origin = f"environment/{file}"

    def fail(where: str, why: str) -> InvalidRequest:
        where = where.strip(".")
        return InvalidRequest(f"task {task}: {origin}: {where} {why}", field=f"{origin}.{where}" if where else origin)

    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidRequest(f"task {task}: {origin} is not YAML: {exc}", field=origin) from None
    if not isinstance(raw, dict):
        raise InvalidRequest(f"task {task}: {origin} is not a mapping", field=origin)
    scope = allowed_env() if env is None else env
    raw = interpolate({k: v for k, v in raw.items() if not str(k).startswith("x-")}, scope, "", fail)
    top = _validate(ComposeFile, raw, "", fail, "only services (and version, name) are read here")
    sidecars: dict[str, Sidecar] = {}
    main = MainOverride()
    for name, body in top.services.items():
        where = f"services.{name}"
        body = {k: v for k, v in (body or {}).items() if not str(k).startswith("x-")}
        if name == MAIN:
            main = _validate(MainOverride, body, where, fail, "main is the task's own image; only its "
                                                             "depends_on and environment may be set here")
            continue
        if not _NAME.match(name):
            raise fail(where, "is not a service name a host name can carry")
        svc = _validate(Service, body, where, fail, "not among the keys honoured here (build, image, environment, "
                        "command, entrypoint, working_dir, expose, ports, healthcheck, depends_on)")
        sidecars[name] = _sidecar(name, svc, where, fail, scope)
    if len(sidecars) > MAX_SERVICES:
        raise fail("services", f"has {len(sidecars)} services besides main; at most {MAX_SERVICES} run here")
    main_depends = _depends(main.depends_on)
    for owner, deps in [(MAIN, main_depends), *((s.name, s.depends_on) for s in sidecars.values())]:
        for dep, condition in deps.items():
            if dep not in sidecars:
                raise fail(f"services.{owner}.depends_on.{dep}", "names no service of this file besides main")
            if condition == "service_healthy" and sidecars[dep].health_disabled:
                raise fail(f"services.{owner}.depends_on.{dep}", f"waits for {dep} to be healthy, whose healthcheck is disabled")
    seen: dict[int, str] = {}
    for sidecar in sidecars.values():
        for port in sidecar.ports:
            if port in seen:
                raise fail(f"services.{sidecar.name}.expose", f"port {port} is {seen[port]}'s too: every service "
                                                               "is reached on 127.0.0.1 here, so two cannot share a port")
            seen[port] = sidecar.name
    return Compose(file=origin, sidecars=_order(sidecars, fail), main_env=_env(main.environment, scope),
                   main_depends_on=main_depends)


def find(environment: str | os.PathLike) -> str | None:
    """The compose file's name in a task's ``environment/``, or None."""
    return next((name for name in FILES if os.path.isfile(os.path.join(environment, name))), None)
