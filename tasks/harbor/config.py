"""``task.toml`` of a Harbor task folder, schema 1.0-1.4: every key either honoured or refused.

The models mirror Harbor's published schema (its ``TaskConfig``), each with ``extra="forbid"``:
a key we do not know is refused, naming its dotted path. Keys we know but cannot honour here are
refused by :func:`refusals` with the reason (a GPU, Windows, a non-root user, sidecar collectors,
a network allow-list, a separate verifier image), never run without. MCP servers and a skills
folder go to the agent (:mod:`tasks.harbor.tools`). What is
honoured, and how, is said on each field; the handler (:mod:`tasks.harbor.handler`) does it.
"""
from __future__ import annotations

import re
import tomllib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from prorl_celery.errors import InvalidRequest
from tasks.harnesses.tools import McpServer

SCHEMAS = ("1.0", "1.1", "1.2", "1.3", "1.4")
NetworkMode = Literal["no-network", "public", "allowlist"]
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.I)
_MB_PER = {"": 1 / (1024 * 1024), "k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Author(_Model):
    name: str
    email: str | None = None


class PackageInfo(BaseModel):
    """``[task]``: recorded in the result (``harbor.task``). Descriptive only, so keys of a task
    author's own (``format``, ``workstream``, ...) are kept and recorded: nothing to honour."""

    model_config = ConfigDict(extra="allow")

    name: str
    version: str | None = None
    description: str = ""
    authors: list[Author] = []
    keywords: list[str] = []


class Healthcheck(_Model):
    """Run before the agent (Docker HEALTHCHECK's polling): every retry failed is an init fault."""

    command: str
    interval_sec: float = 5.0
    timeout_sec: float = 30.0
    start_period_sec: float = 0.0
    start_interval_sec: float = 5.0
    retries: int = Field(3, ge=1)


class _Network(_Model):
    network_mode: NetworkMode | None = Field(None, description="no-network: none; public: the sandbox "
                                             "network when the operator allows it (harbor_allow_internet).")
    allowed_hosts: list[str] | None = Field(None, description="Refused: no per-host allow-list here.")


class AgentPhase(_Network):
    timeout_sec: float | None = Field(None, gt=0, description="The agent's wall time (harness wall_s).")
    user: str | int | None = Field(None, description="Only root (sandboxes map one uid, as root).")


class Environment(_Network):
    build_timeout_sec: float = Field(600.0, gt=0, description="The image build's timeout.")
    docker_image: str | None = Field(None, description="A prebuilt image: built as FROM it.")
    os: str = Field("linux", description="Only linux.")
    cpus: float | None = Field(None, gt=0, description="The sandbox's CPU bandwidth (limits.cpus).")
    memory_mb: int | None = Field(None, gt=0, description="The sandbox's memory (limits.memory_mb).")
    storage_mb: int | None = Field(None, gt=0, description="The sandbox's disk (limits.disk_mb).")
    gpus: int | None = Field(None, ge=0, description="Only 0: no GPU sandboxes here.")
    gpu_types: list[str] | None = None
    tpu: dict[str, Any] | None = None
    mcp_servers: list[McpServer] = Field([], description="Given to a harness that takes MCP (tasks.harbor.tools).")
    env: dict[str, str] = Field({}, description="The sandbox's environment (agent and verifier).")
    skills_dir: str | None = Field(None, pattern=r"^/[^\x00]*$", description="A folder of skills in the image "
                                   "(<name>/SKILL.md): copied where the harness reads skills, else appended to the "
                                   "instruction (tasks.harbor.tools).")
    healthcheck: Healthcheck | None = None
    workdir: str | None = Field(None, description="The agent's working directory (else the image's WORKDIR).")
    allow_internet: bool | None = Field(None, description="Deprecated form of network_mode.")

    @model_validator(mode="before")
    @classmethod
    def _legacy_sizes(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in (("memory", "memory_mb"), ("storage", "storage_mb")):
                if old in data:
                    data = {**data}
                    value = data.pop(old)
                    data.setdefault(new, _size_mb(value, old))
        return data


class Verifier(_Network):
    timeout_sec: float = Field(600.0, gt=0, description="test.sh's wall time; past it: an infrastructure fault.")
    env: dict[str, str] = Field({}, description="test.sh's environment (over the task's).")
    user: str | int | None = None
    environment_mode: Literal["shared", "separate"] | None = Field(
        None, description="separate (our default): a fresh sandbox of the image; shared: the agent's own, "
        "only where the operator opts in (harbor_shared_verifier).")
    environment: dict[str, Any] | None = Field(None, description="Refused: a verifier image of its own.")
    collect: list[dict[str, Any]] = []


class Artifact(_Model):
    source: str
    destination: str | None = None
    exclude: list[str] = []
    service: str | None = None


class Step(_Model):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    agent: AgentPhase = AgentPhase()
    verifier: Verifier | None = None
    min_reward: float | dict[str, float] | None = None
    healthcheck: Healthcheck | None = None
    artifacts: list[str | Artifact] = []


class Solution(_Model):
    env: dict[str, str] = Field({}, description="solve.sh's environment (the oracle's).")


class TaskConfig(_Model):
    schema_version: str = "1.0"
    task: PackageInfo | None = None
    metadata: dict[str, Any] = {}
    verifier: Verifier = Verifier()
    agent: AgentPhase = AgentPhase()
    environment: Environment = Environment()
    solution: Solution = Solution()
    source: str | None = None
    multi_step_reward_strategy: Literal["mean", "final"] | None = None
    steps: list[Step] | None = None
    artifacts: list[str | Artifact] = []

    @model_validator(mode="before")
    @classmethod
    def _version_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and "version" in data:
            data = {**data}
            data.setdefault("schema_version", str(data.pop("version")))
        return data


def _size_mb(value: Any, key: str) -> int:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"{key}: {value!r} is not a size such as '2G' or '512M'")
    return max(1, int(float(match.group(1)) * _MB_PER[match.group(2).lower()]))


def _where(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc)


def parse(text: str, origin: str = "task.toml") -> TaskConfig:
    """The task.toml ``text`` as a :class:`TaskConfig`; a key unknown or malformed, or one this
    service cannot honour (:func:`refusals`), is :class:`InvalidRequest` naming it."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidRequest(f"{origin} is not TOML: {exc}", field="task.toml") from None
    try:
        config = TaskConfig.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = _where(err["loc"])
        what = "is not a task.toml key" if err["type"] == "extra_forbidden" else err["msg"]
        raise InvalidRequest(f"{origin}: {where} {what}", field=f"task.toml.{where}") from None
    problems = refusals(config)
    if problems:
        key, why = problems[0]
        raise InvalidRequest(f"{origin}: {key} cannot be honoured here: {why}", field=f"task.toml.{key}")
    return config


def _phase_refusals(prefix: str, phase: _Network) -> list[tuple[str, str]]:
    out = []
    if phase.network_mode == "allowlist" or phase.allowed_hosts:
        out.append((f"{prefix}.allowed_hosts", "no per-host network allow-list here (no-network or public only)"))
    user = getattr(phase, "user", None)
    if user not in (None, "root", 0, "0"):
        out.append((f"{prefix}.user", f"sandboxes run their commands as root; user {user!r} cannot be had"))
    return out


def refusals(config: TaskConfig) -> list[tuple[str, str]]:
    """(dotted key, why) for each known key this service cannot honour."""
    env = config.environment
    out: list[tuple[str, str]] = []
    if config.schema_version not in SCHEMAS:
        out.append(("schema_version", f"{config.schema_version!r} is not one of {', '.join(SCHEMAS)}"))
    if env.os.lower() != "linux":
        out.append(("environment.os", f"only linux sandboxes here, not {env.os!r}"))
    if env.gpus:
        out.append(("environment.gpus", "no GPU sandboxes here"))
    for key, value, why in (("environment.gpu_types", env.gpu_types, "no GPU sandboxes here"),
                            ("environment.tpu", env.tpu, "no TPU sandboxes here")):
        if value:
            out.append((key, why))
    out += _phase_refusals("environment", env) + _phase_refusals("agent", config.agent)
    for prefix, verifier in [("verifier", config.verifier)] + [
            (f"steps.{i}.verifier", s.verifier) for i, s in enumerate(config.steps or []) if s.verifier]:
        out += _phase_refusals(prefix, verifier)
        if verifier.environment:
            out.append((f"{prefix}.environment", "a separate verifier image is not built here"))
        if verifier.collect:
            out.append((f"{prefix}.collect", "sidecar collectors are not run here"))
    for i, step in enumerate(config.steps or []):
        out += _phase_refusals(f"steps.{i}.agent", step.agent)
    for key, items in [("artifacts", config.artifacts)] + [
            (f"steps.{i}.artifacts", s.artifacts) for i, s in enumerate(config.steps or [])]:
        for item in items:
            if isinstance(item, Artifact) and item.service not in (None, "main"):
                out.append((key, f"artifact of service {item.service!r}: a sidecar's files are not collected here"))
    servers = [s.name for s in env.mcp_servers]
    if len(set(servers)) != len(servers):
        out.append(("environment.mcp_servers", "MCP server names must be unique"))
    names = [s.name for s in config.steps or []]
    if len(set(names)) != len(names):
        out.append(("steps", "step names must be unique"))
    return out


def wants_internet(config: TaskConfig, phase: _Network | None = None) -> bool:
    """Whether the task asks for the public network in ``phase`` (else its environment's)."""
    if phase is not None and phase.network_mode is not None:
        return phase.network_mode == "public"
    env = config.environment
    if env.network_mode is not None:
        return env.network_mode == "public"
    return bool(env.allow_internet) if env.allow_internet is not None else True
