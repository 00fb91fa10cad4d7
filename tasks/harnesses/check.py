"""``check_harness``: the one conformance check every harness class passes when it is loaded."""
from __future__ import annotations

import inspect

from pydantic import BaseModel

from prorl_celery.errors import UnknownPlugin


def check_harness(cls: type) -> None:
    """Refuse a class that is not a harness, naming what is wrong: a ``name``, a pydantic
    ``config_class`` that forbids unknown fields, ``launch(task, config)`` and
    ``finish_reason(exit_code, output)``, construction without arguments."""
    problems = []
    if not isinstance(getattr(cls, "name", None), str) or not cls.name:
        problems.append("no 'name'")
    config = getattr(cls, "config_class", None)
    if not (inspect.isclass(config) and issubclass(config, BaseModel)):
        problems.append("'config_class' is not a pydantic model")
    elif config.model_config.get("extra") != "forbid":
        problems.append("'config_class' must forbid unknown fields (extra='forbid')")
    for method, params in (("launch", ["task", "config"]), ("finish_reason", ["exit_code", "output"])):
        fn = getattr(cls, method, None)
        if not callable(fn):
            problems.append(f"no {method}()")
        elif list(inspect.signature(fn).parameters)[1:] != params:
            problems.append(f"{method} must take ({', '.join(params)})")
    try:
        cls()
    except Exception as exc:  # noqa: BLE001 - reported as the reason it does not conform
        problems.append(f"cannot be constructed without arguments: {exc}")
    if problems:
        raise UnknownPlugin(f"harness {cls.__module__}.{cls.__qualname__} does not conform: {'; '.join(problems)}")
