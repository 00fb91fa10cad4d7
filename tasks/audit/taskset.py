"""Task sets the audit reads: Harbor task folders (a folder, or a folder of them) and JSONL files
of instances (any domain; a SWE-bench row without ``data_source`` is a ``swebench`` instance)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prorl_celery.errors import InvalidRequest

AGENT_KEYS = ("agent", "trajectory_id")  # what the audit replaces on an instance


@dataclass(frozen=True)
class AuditTask:
    name: str
    instance: dict[str, Any]


def harbor_dirs(path: Path) -> list[Path]:
    """A task folder (holds task.toml), or the task folders directly in it, sorted."""
    if (path / "task.toml").is_file():
        return [path]
    return sorted(p for p in path.iterdir() if (p / "task.toml").is_file()) if path.is_dir() else []


def from_row(row: dict[str, Any]) -> dict[str, Any]:
    """An instance from a JSONL row: as it is, or a SWE-bench row made a ``swebench`` instance."""
    if "data_source" not in row and "base_commit" in row:
        row = {"data_source": "swebench", **row}
    if "data_source" not in row:
        raise InvalidRequest("a row has neither data_source nor base_commit (a SWE-bench row)", field="data_source")
    return {k: v for k, v in row.items() if k not in AGENT_KEYS}


def name_of(instance: dict[str, Any], index: int) -> str:
    if instance.get("task_dir"):
        return Path(instance["task_dir"]).name
    return str(instance.get("instance_id") or instance.get("task_id") or instance.get("id") or f"row{index}")


def load(paths: list[str]) -> list[AuditTask]:
    """Every task in the given folders and JSONL files, in order."""
    tasks: list[AuditTask] = []
    for raw in paths:
        path = Path(raw).resolve()
        if path.is_file() and path.suffix in (".jsonl", ".json"):
            lines = [line for line in path.read_text().splitlines() if line.strip()]
            for i, line in enumerate(lines):
                instance = from_row(json.loads(line))
                tasks.append(AuditTask(name_of(instance, i), instance))
            continue
        found = harbor_dirs(path)
        if not found:
            raise InvalidRequest(f"{raw} is neither a Harbor task folder, a folder of them, nor a JSONL file",
                                 field="paths")
        tasks += [AuditTask(p.name, {"data_source": "harbor", "task_dir": str(p)}) for p in found]
    return tasks
