"""``check_handler``: the conformance check every handler passes before it serves a job.

In the spirit of Gymnasium's ``check_env``: what the stages, the API and the result builder will
call is checked once, when the class is first loaded, so that a handler of an operator's package
that cannot be called the way the stages call it is refused at submission with a message naming
the method, instead of failing every job at its first stage.
"""
from __future__ import annotations

import inspect
import json
from typing import Any

from prorl_celery.errors import UnknownPlugin
from tasks.handlers.base import AgentHandler

STAGES = ("init", "run", "eval")
# optional hooks and the arguments the service passes them (besides ``self``)
HOOKS: dict[str, tuple[str, ...]] = {"check_instance": ("instance",), "sandbox_need": ("instance",),
                                     "result_fields": ("state",),
                                     "on_exception": ("ctx", "exc"), "finish": ("ctx",)}


def _takes(cls: type, method: str, args: tuple[str, ...]) -> str | None:
    """Why ``cls.method`` cannot be called with ``args`` positionally (None: it can)."""
    func = getattr(cls, method, None)
    if not callable(func):
        return f"{method} is not a method"
    try:
        inspect.signature(func).bind(None, *args)
    except TypeError as exc:
        return f"{method}({', '.join(args)}) cannot be called: {exc}"
    except ValueError:  # no signature to read (a builtin): trust it
        return None
    return None


def _problems(cls: type) -> list[str]:
    problems = [why for stage in STAGES if (why := _takes(cls, stage, ("ctx",)))]
    problems += [why for hook, args in HOOKS.items() if hasattr(cls, hook) and (why := _takes(cls, hook, args))]
    if not isinstance(getattr(cls, "name", ""), str):
        problems.append("name is not a string")
    try:
        inspect.signature(cls).bind()
    except TypeError as exc:
        problems.append(f"it cannot be created without arguments: {exc}")
    except ValueError:
        pass
    return problems


def _empty_state_fields(handler: Any) -> str | None:
    """A job that failed before its first save has an empty state; its result is still built from
    ``result_fields``, so that must give a JSON object for ``{}``."""
    try:
        fields = handler.result_fields({})
        json.dumps(fields)
    except Exception as exc:  # noqa: BLE001 - whatever it raises is the finding
        return f"result_fields({{}}) raised {type(exc).__name__}: {exc}"
    if not isinstance(fields, dict) or not all(isinstance(k, str) for k in fields):
        return f"result_fields({{}}) returned {type(fields).__name__}, not a dict with string keys"
    return None


def conform(cls: type) -> type:
    """``cls`` with the optional hooks it leaves out taken from :class:`AgentHandler`."""
    if issubclass(cls, AgentHandler):
        return cls
    return type(cls.__name__, (cls, AgentHandler), {"__module__": cls.__module__})


def check_handler(cls: type) -> None:
    """Raise :class:`UnknownPlugin` listing everything that keeps ``cls`` from serving jobs."""
    problems = _problems(cls)
    if not problems:
        why = _empty_state_fields(conform(cls)())
        problems += [why] if why else []
    if problems:
        raise UnknownPlugin(f"handler {cls.__module__}:{cls.__qualname__} does not conform: "
                            + "; ".join(problems))
