"""A Harbor task folder read whole: its config, its steps (one implicit step for a single-step
task) and the files each phase gets.

Layout (Harbor's): ``task.toml``, ``instruction.md``, ``environment/`` (``Dockerfile``, or
``[environment] docker_image``), ``tests/`` (``test.sh`` writes ``/logs/verifier/reward.txt`` or
``reward.json``), optional ``solution/solve.sh``; a multi-step task has ``steps/<name>/`` each with
its ``instruction.md``, ``tests/``, ``solution/`` and ``workdir/`` (uploaded into the working
directory before the agent, ``workdir/setup.sh`` run then removed), the task's own ``tests/``
merged under each step's. A folder must lie beneath a directory the operator lists in
``PRORL_HARBOR_TASK_DIRS``, as repository sources must. The agent never sees ``tests/`` or
``solution/`` (the oracle excepted, which is given ``solution/``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from prorl_celery.errors import InvalidRequest, PolicyDenied
from sandboxes.dirs import beneath, split_dirs
from tasks.harbor import compose as compose_file
from tasks.harbor.compose import Compose
from tasks.harbor.config import Artifact, Healthcheck, TaskConfig, parse

MAX_INSTRUCTION = 256 * 1024


@dataclass
class Step:
    """One step as it runs: what the agent gets, then what grades it."""

    name: str
    instruction: str
    tests: list[Path]  # directories merged into /tests, later ones over earlier ones
    solution: Path | None
    workdir_files: Path | None
    agent_timeout_s: float | None
    verifier_timeout_s: float
    verifier_env: dict[str, str]
    min_reward: float | dict[str, float] | None = None
    healthcheck: Healthcheck | None = None
    artifacts: list[Artifact] = field(default_factory=list)


@dataclass
class HarborTask:
    root: Path
    config: TaskConfig
    steps: list[Step]
    compose: Compose | None = None  # environment/docker-compose.yaml's sidecars (tasks.harbor.sidecars)

    @property
    def name(self) -> str:
        return self.config.task.name if self.config.task else self.root.name

    @property
    def multi_step(self) -> bool:
        return bool(self.config.steps)

    @property
    def environment(self) -> Path:
        return self.root / "environment"

    def strategy(self) -> str:
        return self.config.multi_step_reward_strategy or "mean"


def _allowed(path: str, field_name: str) -> Path:
    from config.settings import get_settings

    roots = split_dirs(get_settings().harbor_task_dirs)
    if not isinstance(path, str) or not os.path.isabs(path) or "\x00" in path:
        raise InvalidRequest("task_dir must be an absolute path to a Harbor task folder", field=field_name)
    if not beneath(path, roots, lexical=False):
        raise PolicyDenied(f"task_dir {path!r} is not beneath a directory the operator allows "
                           f"(PRORL_HARBOR_TASK_DIRS: {', '.join(roots) or 'none'}), after resolving links",
                           field=field_name)
    return Path(os.path.realpath(path))


def _read(path: Path, field_name: str) -> str:
    if not path.is_file():
        raise InvalidRequest(f"{path} is missing", field=field_name)
    if path.stat().st_size > MAX_INSTRUCTION:
        raise InvalidRequest(f"{path} is larger than {MAX_INSTRUCTION} bytes", field=field_name)
    return path.read_text(errors="replace")


def _dir(path: Path) -> Path | None:
    return path if path.is_dir() else None


def _artifacts(items: list) -> list[Artifact]:
    return [Artifact(source=item) if isinstance(item, str) else item for item in items]


def _steps(root: Path, config: TaskConfig) -> list[Step]:
    top_tests = [root / "tests"] if (root / "tests").is_dir() else []
    task_artifacts = _artifacts(config.artifacts)
    if not config.steps:
        if not (root / "tests" / "test.sh").is_file():
            raise InvalidRequest(f"{root}/tests/test.sh is missing", field="task_dir")
        return [Step(name="main", instruction=_read(root / "instruction.md", "task_dir"), tests=top_tests,
                     solution=_dir(root / "solution"), workdir_files=None,
                     agent_timeout_s=config.agent.timeout_sec, verifier_timeout_s=config.verifier.timeout_sec,
                     verifier_env=dict(config.verifier.env), healthcheck=config.environment.healthcheck,
                     artifacts=task_artifacts)]
    steps = []
    for spec in config.steps:
        here = root / "steps" / spec.name
        tests = top_tests + ([here / "tests"] if (here / "tests").is_dir() else [])
        if not any((d / "test.sh").is_file() for d in tests):
            raise InvalidRequest(f"step {spec.name!r} has no tests/test.sh", field=f"task.toml.steps.{spec.name}")
        verifier = spec.verifier
        steps.append(Step(
            name=spec.name, instruction=_read(here / "instruction.md", f"task.toml.steps.{spec.name}"),
            tests=tests, solution=_dir(here / "solution"), workdir_files=_dir(here / "workdir"),
            agent_timeout_s=spec.agent.timeout_sec or config.agent.timeout_sec,
            verifier_timeout_s=(verifier.timeout_sec if verifier and "timeout_sec" in verifier.model_fields_set
                                else config.verifier.timeout_sec),
            verifier_env={**config.verifier.env, **(verifier.env if verifier else {})},
            min_reward=spec.min_reward, healthcheck=spec.healthcheck or config.environment.healthcheck,
            artifacts=task_artifacts + _artifacts(spec.artifacts)))
    return steps


def load(task_dir: str, field_name: str = "instance.task_dir") -> HarborTask:
    """The task folder at ``task_dir`` (beneath an allowed root), read and checked whole: a key of
    its task.toml or its compose file this service cannot honour, a missing file, are
    :class:`InvalidRequest` naming what."""
    root = _allowed(task_dir, field_name)
    if not root.is_dir():
        raise InvalidRequest(f"task_dir {task_dir!r} is not a directory", field=field_name)
    return read(root, field_name)


def read(root: Path, field_name: str = "instance.task_dir") -> HarborTask:
    """The task folder ``root`` read and checked whole, wherever it is (:func:`load` is this
    beneath the operator's roots)."""
    config = parse(_read(root / "task.toml", field_name), origin=f"{root.name}/task.toml")
    name = compose_file.find(root / "environment")
    compose = None
    if name is not None:
        text = (root / "environment" / name).read_text(errors="replace")
        compose = compose_file.parse(text, config.task.name if config.task else root.name, name)
    if not config.environment.docker_image and not (root / "environment" / "Dockerfile").is_file():
        raise InvalidRequest(f"task {root.name}: no environment/Dockerfile and no [environment] docker_image",
                             field="task.toml.environment")
    return HarborTask(root=root, config=config, steps=_steps(root, config), compose=compose)
