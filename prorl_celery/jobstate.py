"""A job's state: what a running job keeps between saves, typed.

The job store holds it as one JSON object (the ``state`` field of the job's hash,
:mod:`prorl_celery.jobs`); a stage reads it as a :class:`JobState`
(:attr:`tasks.context.StageContext.state`) and saves :meth:`JobState.dump`. The service's own
keys are fields here, each with its type; a handler's own keys (``repo_dir``, ``steps``,
``git_patch`` ...) are the rest, read and written as on a dict (``ctx.state["repo_dir"]``), so a
handler of a user's, written against a dict, runs unchanged. The stored form is the dict it was
before this type: the keys that start with ``_`` keep their names, a field that is None is
absent.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

ROLLOUT_KEY = "_rollout"
ADMISSION_KEY = "_admission"
SANDBOX_KEY = "_sandbox"
INIT_WAIT_KEY = "_init_wait_s"
USAGE_KEY = "_sandbox_usage"
AGENT_KEY = "agent"
HARNESS_KEY = "harness"
RESTARTS_KEY = "harness_restarts"


class RolloutCounts(BaseModel):
    """How much of the job's rollout (:mod:`prorl_celery.rollout.store`) a save stored: a reader
    takes this many calls and messages, a record past them is a write that lost its job."""

    calls: int = 0
    messages: int = 0


class Admission(BaseModel):
    """Admission control let the rollout start (:meth:`tasks.context.StageContext.admit`)."""

    wait_s: float = Field(description="Seconds the run stage was held, not charged to its budget.")
    version: Any = Field(None, description="The weight version current when it was let in.")


class JobState(BaseModel):
    """The service's keys of a job's state; any other key is its handler's (see the module)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    rollout: RolloutCounts | None = Field(None, alias=ROLLOUT_KEY, description="The rollout saved so far.")
    admission: Admission | None = Field(None, alias=ADMISSION_KEY)
    sandbox: dict[str, Any] | None = Field(
        None, alias=SANDBOX_KEY, description="The result's ``sandbox`` block: what the host started.")
    init_wait_s: float | None = Field(
        None, alias=INIT_WAIT_KEY, description="Seconds init waited for a sandbox (``timings.init_wait``).")
    sandbox_usage: dict[str, Any] | None = Field(
        None, alias=USAGE_KEY, description="What the job's closed sandboxes used, as their hosts read their "
                                           "cgroups (``cost.sandbox``: :func:`prorl_celery.rollout.cost.add_usage`).")
    agent: dict[str, Any] | None = Field(
        None, alias=AGENT_KEY, description="The built-in agent's episode (:class:`tasks.agent.episode.Episode`).")
    harness: dict[str, Any] | None = Field(
        None, alias=HARNESS_KEY, description="A harness's run: which, its session, route, how it ended "
                                             "(:mod:`tasks.harnesses.run`).")
    harness_restarts: int | None = Field(
        None, alias=RESTARTS_KEY, description="How often the harness ran again, its session lost with its worker.")

    @classmethod
    def of(cls, state: JobState | Mapping[str, Any] | None) -> JobState:
        """``state`` as a JobState (the same object if it is one)."""
        if isinstance(state, JobState):
            return state
        return cls.model_validate(dict(state or {}))

    def dump(self) -> dict[str, Any]:
        """The stored form: the set fields by their keys, then the handler's keys (not copied)."""
        out: dict[str, Any] = {}
        for key, name in _FIELDS.items():
            value = getattr(self, name)
            if value is not None:  # the typed blocks hold scalars only: their __dict__ is their dump, 5x cheaper
                out[key] = dict(value.__dict__) if isinstance(value, BaseModel) else value
        out.update(self.__pydantic_extra__ or {})
        return out

    # -- as a mapping, by stored key (what a handler's code reads and writes) -------------------
    def __getitem__(self, key: str) -> Any:
        name = _FIELDS.get(key)
        if name is None:
            return (self.__pydantic_extra__ or {})[key]
        value = getattr(self, name)
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key: str, value: Any) -> None:
        name = _FIELDS.get(key)
        if name is None:
            self.__pydantic_extra__[key] = value  # never setattr: a handler's key is no attribute
        else:
            setattr(self, name, value)

    def __contains__(self, key: object) -> bool:
        name = _FIELDS.get(key)  # type: ignore[arg-type]
        return getattr(self, name) is not None if name else key in (self.__pydantic_extra__ or {})

    def keys(self) -> list[str]:
        return list(self.dump())

    def items(self) -> list[tuple[str, Any]]:
        return [(key, self[key]) for key in self.keys()]

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def pop(self, key: str, *default: Any) -> Any:
        if key not in self:
            if default:
                return default[0]
            raise KeyError(key)
        value = self[key]
        name = _FIELDS.get(key)
        if name is None:
            del self.__pydantic_extra__[key]
        else:
            setattr(self, name, None)
        return value


_FIELDS = {info.alias or name: name for name, info in JobState.model_fields.items()}  # stored key -> field
