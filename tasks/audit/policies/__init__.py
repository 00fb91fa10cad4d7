"""The hack policies: one shell script per class of attack (``<name>.sh`` in this folder), run as
the agent by the ``command`` harness, each after the shared prelude ``_lib.sh``. A policy knows no
task: it works on whatever the sandbox shows (the working directory, the instruction in
``$PRORL_TASK_FILE``) and draws the names of what it writes at run time. Its ``audit: ...`` lines
on stdout say what it did (the result's ``harness.output``)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from prorl_celery.errors import InvalidRequest

HERE = Path(__file__).resolve().parent
COMMAND_MAX = 8192  # the command harness's limit on its command line
NOOP_NAME = "noop"


@dataclass(frozen=True)
class Policy:
    name: str
    hack_class: str  # the class of attack it stands for (its ``# class:`` line)
    script: str  # what the harness runs: the prelude, then the policy

    def agent(self) -> dict[str, Any]:
        """The instance's agent block that runs this policy."""
        return {"harness": "command", "command": self.script}


NOOP = Policy(NOOP_NAME, "an agent that does nothing (the baseline)", "true")


def _read(path: Path, prelude: str) -> Policy:
    text = path.read_text()
    cls = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("# class:")), "")
    return Policy(path.stem, cls, prelude + "\n" + text)


@lru_cache(maxsize=1)
def library() -> dict[str, Policy]:
    """Every policy of this folder by name (files starting with ``_`` are helpers)."""
    prelude = (HERE / "_lib.sh").read_text()
    return {p.stem: _read(p, prelude) for p in sorted(HERE.glob("*.sh")) if not p.name.startswith("_")}


def select(names: list[str] | None) -> list[Policy]:
    """The named policies (all when None), in the library's order; an unknown name is refused,
    listing the known ones."""
    known = library()
    if not names:
        return list(known.values())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise InvalidRequest(f"unknown hack policies {unknown}; known: {', '.join(known)}", field="policies")
    return [known[n] for n in known if n in names]


def is_audit_agent(agent: Any) -> bool:
    """Whether an instance's agent block is the audit's own (the no-op or a library policy, word
    for word): such a job may run a quarantined task, since no model learns from it."""
    if not isinstance(agent, dict) or set(agent) != {"harness", "command"} or agent["harness"] != "command":
        return False
    return agent["command"] == NOOP.script or any(agent["command"] == p.script for p in library().values())
