"""Quarantine: the audit's verdicts kept in Redis by the task's content hash, and the check at
submission.

A task's content hash covers what its grader reads: a Harbor folder's files (names and bytes),
a SWE-bench row's grading fields, any other instance whole (but its agent, sandbox and sample
number). A verdict counts while its grader version is the grader's current one
(``GRADER_VERSION`` beside each grader): a change of the task's files or of the grader lifts it.
At submission a hackable task is refused (409 ``task_quarantined``, naming the task and the
policies), accepted with a warning, or allowed, per the operator's ``audit_policy``; the audit's
own agents (:func:`tasks.audit.policies.is_audit_agent`) always run.

A hack no scripted policy can find (a task-specific shortcut found by reading the task's tests)
is quarantined by the operator's own verdict (:func:`mark`, ``prorl-celery quarantine``): the
policy ``operator`` and the reason, lifted like any verdict (or by :func:`lift`)."""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import time
from typing import Any

from prorl_celery import keys
from prorl_celery.errors import TaskQuarantined
from prorl_celery.redisio import text

GRADERS = {"harbor": "tasks.harbor.verifier", "swebench": "tasks.swe.grader", "swe": "tasks.swe.grader",
           "lookup": "tasks.handlers.lookup"}
SWE_FIELDS = ("repo", "version", "base_commit", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS", "eval_script",
              "log_parser", "test_cmd", "image", "environment_setup_commit")
NOT_GRADED = ("agent", "sandbox", "trajectory_id")
POLICIES = ("refuse", "warn", "allow")


def grader_version(data_source: str) -> str:
    """The current version of the data source's grader (``GRADER_VERSION`` in its module), else "1"."""
    module = GRADERS.get(data_source)
    return str(getattr(importlib.import_module(module), "GRADER_VERSION", "1")) if module else "1"


def _folder_hash(root: str) -> str:
    digest = hashlib.sha256()
    for here, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(here, name)
            digest.update(os.path.relpath(path, root).encode() + b"\0")
            if os.path.islink(path):
                digest.update(b"link:" + os.readlink(path).encode())
            else:
                with open(path, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 20), b""):
                        digest.update(block)
            digest.update(b"\0")
    return digest.hexdigest()


def content_hash(instance: dict[str, Any]) -> str:
    """The hash of what the instance's grader reads (see the module's docstring)."""
    source = str(instance.get("data_source"))
    if source == "harbor" and isinstance(instance.get("task_dir"), str):
        inner = _folder_hash(os.path.realpath(instance["task_dir"]))
    elif source in ("swebench", "swe"):
        inner = json.dumps({k: instance.get(k) for k in SWE_FIELDS}, sort_keys=True, default=str)
    else:
        inner = json.dumps({k: v for k, v in instance.items() if k not in NOT_GRADED}, sort_keys=True, default=str)
    return hashlib.sha256(f"{source}\0{inner}".encode()).hexdigest()[:32]


def store(redis: Any, verdict: dict[str, Any]) -> None:
    """Keep one task's verdict (a :class:`~tasks.audit.verdict.TaskVerdict` as JSON) by its hash."""
    summary = {k: verdict.get(k) for k in ("task", "data_source", "hackable", "policies", "content_hash",
                                           "grader_version", "baseline")}
    if verdict.get("reason"):  # the operator's verdict says why
        summary["reason"] = verdict["reason"]
    summary["audited_at"] = verdict.get("audited_at")
    pipe = redis.pipeline()
    pipe.set(keys.audit_verdict(verdict["content_hash"]), json.dumps(summary))
    pipe.sadd(keys.audit_verdicts(), verdict["content_hash"])
    pipe.execute()


def mark(redis: Any, task: str, instance: dict[str, Any], reason: str) -> dict[str, Any]:
    """The operator's verdict: ``instance`` is hackable for ``reason`` (policy ``operator``), by its
    content hash and today's grader version; stored and returned."""
    if not reason.strip():
        raise ValueError("an operator's verdict needs a reason")
    source = str(instance.get("data_source"))
    verdict = {"task": task, "data_source": source, "hackable": True, "policies": ["operator"],
               "content_hash": content_hash(instance), "grader_version": grader_version(source),
               "baseline": None, "reason": reason.strip(), "audited_at": time.time()}
    store(redis, verdict)
    return verdict


def lift(redis: Any, instance: dict[str, Any]) -> bool:
    """Remove the verdict stored for ``instance``'s content (an audit's or the operator's)."""
    digest = content_hash(instance)
    pipe = redis.pipeline()
    pipe.delete(keys.audit_verdict(digest))
    pipe.srem(keys.audit_verdicts(), digest)
    return bool(pipe.execute()[0])


def verdicts(redis: Any) -> list[dict[str, Any]]:
    """Every stored verdict, with ``current``: whether its grader version is today's."""
    hashes = sorted(text(h) for h in redis.smembers(keys.audit_verdicts()))
    out = []
    for raw in redis.mget([keys.audit_verdict(h) for h in hashes]) if hashes else []:
        if raw:
            item = json.loads(raw)
            item["current"] = item.get("grader_version") == grader_version(item.get("data_source") or "")
            out.append(item)
    return out


def hackable_verdict(redis: Any, instance: dict[str, Any]) -> dict[str, Any] | None:
    """The stored verdict that quarantines this instance now, or None."""
    raw = redis.get(keys.audit_verdict(content_hash(instance)))
    if not raw:
        return None
    item = json.loads(raw)
    current = item.get("grader_version") == grader_version(str(instance.get("data_source")))
    return item if item.get("hackable") and current else None


def check(redis: Any, instances: list[dict[str, Any]], policy: str) -> list[dict[str, Any]]:
    """At submission: raise :class:`TaskQuarantined` for a hackable task under ``refuse``; return
    the warnings for them under ``warn``; nothing under ``allow``. The audit's own runs pass."""
    from tasks.audit.policies import is_audit_agent

    if policy == "allow" or not redis.scard(keys.audit_verdicts()):
        return []
    warnings, seen = [], set()
    for instance in instances:
        if is_audit_agent(instance.get("agent")):
            continue
        marker = json.dumps({k: v for k, v in instance.items() if k not in NOT_GRADED}, sort_keys=True, default=str)
        if marker in seen:
            continue
        seen.add(marker)
        found = hackable_verdict(redis, instance)
        if found is None:
            continue
        if policy == "refuse":
            raise TaskQuarantined(found["task"], found.get("policies") or [], found["content_hash"])
        warnings.append({"type": "task_quarantined", "task": found["task"], "policies": found.get("policies") or [],
                         "content_hash": found["content_hash"],
                         "message": f"task {found['task']} is hackable by {', '.join(found.get('policies') or [])} "
                                    "(the hack audit); accepted because PRORL_AUDIT_POLICY=warn"})
    return warnings
