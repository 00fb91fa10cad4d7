"""What the built-in handlers refuse in an instance at submission, before anything is stored.

A module of its own and light (no handler, agent or verifier behind it), so that the API process
checks a request without importing the handlers: ``tasks/handlers/__init__.py`` registers each
built-in handler's check here next to the handler's dotted path, and each handler's own
``check_instance`` calls the same function. Each check raises
:class:`~prorl_celery.errors.PolicyDenied` or :class:`~prorl_celery.errors.InvalidRequest`
naming the field. The sandbox host and the worker check again, with the facts of their node.
"""
from __future__ import annotations

import re
from typing import Any

from prorl_celery.errors import InvalidRequest

_COMMIT = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?$")


def check_sandbox(instance: dict[str, Any]) -> None:
    """Every handler's: the ``sandbox`` block's runtime and image under the operator's policy,
    and an ``agent`` block that names a harness."""
    from sandboxes.policy import check_request_sandbox
    from tasks.harnesses import check_instance_agent

    check_request_sandbox(instance.get("sandbox"))
    check_instance_agent(instance)  # a harness instead of the built-in agent: its block


def check_no_agent(instance: dict[str, Any]) -> None:
    """A domain that runs no agent (``shell``): an ``agent`` block is refused, not ignored."""
    check_sandbox(instance)
    if instance.get("agent") is not None:
        raise InvalidRequest("this data_source runs no agent: an agent block cannot be honoured",
                             field="instance.agent")


def check_harbor(instance: dict[str, Any]) -> None:
    """``harbor``'s: a task folder beneath ``harbor_task_dirs`` whose task.toml is honoured whole
    (:func:`tasks.harbor.task.load`: every key either honoured or refused, naming it)."""
    from tasks.harbor import tools
    from tasks.harbor.task import load

    check_sandbox(instance)
    task_dir = instance.get("task_dir")
    if not isinstance(task_dir, str):
        raise InvalidRequest("task_dir: the path of a Harbor task folder is required", field="instance.task_dir")
    if not isinstance(instance.get("fork", True), bool):
        raise InvalidRequest("fork: true (a group prepares once, tasks/harbor/fork.py) or false", field="instance.fork")
    tools.check(load(task_dir), instance)


def harbor_sandbox_need(instance: dict[str, Any]) -> int:
    """``harbor``'s sandbox need (:meth:`tasks.handlers.base.AgentHandler.sandbox_need`): the
    agent's sandbox, one per sidecar service of its compose file (kept by the agent's, they live as
    long), and the verifier's fresh sandbox, which each step opens while the agent's still lives
    (none where the operator lets a ``shared`` task grade in the agent's own). The instance is
    checked first (:func:`check_harbor`)."""
    from config.settings import get_settings
    from tasks.harbor.task import load

    task = load(instance["task_dir"])
    shared = task.config.verifier.environment_mode == "shared" and get_settings().harbor_shared_verifier
    return 1 + (len(task.compose.sidecars) if task.compose else 0) + (0 if shared else 1)


ECHO_TOOL_SETS = ("none", "submit", "all")


def check_echo(instance: dict[str, Any]) -> None:
    """``echo``'s: also a non-empty ``text``, ``tools`` one of none, submit, all, and ``match``
    exact or contains."""
    check_sandbox(instance)
    text = instance.get("text")
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequest("text: a non-empty string is required", field="instance.text")
    if instance.get("tools", "none") not in ECHO_TOOL_SETS:
        raise InvalidRequest(f"tools: one of {', '.join(ECHO_TOOL_SETS)}", field="instance.tools")
    if instance.get("match", "exact") not in ("exact", "contains"):
        raise InvalidRequest("match: exact or contains", field="instance.match")
    agent = instance.get("agent")
    if isinstance(agent, dict) and "harness" in agent:  # its run is the built-in agent's, always
        raise InvalidRequest("echo runs the built-in agent only: a harness agent block cannot be honoured",
                             field="instance.agent")


_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_lookup(instance: dict[str, Any]) -> None:
    """``files`` a map of plain file names to texts (2 to 16), ``target`` one of them, ``code``
    a non-empty string found in the target's text."""
    check_sandbox(instance)
    files = instance.get("files")
    if not isinstance(files, dict) or not 2 <= len(files) <= 16:
        raise InvalidRequest("files: 2 to 16 {name: text}", field="instance.files")
    for name, text in files.items():
        if not isinstance(name, str) or not _FILE_NAME.match(name) or not isinstance(text, str) or len(text) > 4096:
            raise InvalidRequest(f"files: {name!r}: a plain file name and a text of at most 4 kB",
                                 field="instance.files")
    if instance.get("target") not in files:
        raise InvalidRequest("target: one of the files' names", field="instance.target")
    code = instance.get("code")
    if not isinstance(code, str) or not code.strip() or code not in files[instance["target"]]:
        raise InvalidRequest("code: a non-empty string the target file holds", field="instance.code")


def check_swe(instance: dict[str, Any]) -> None:
    """``swe``'s: also the instance's ``image`` and ``repo_source`` (https, or an allowed
    directory), the test lists, and a full ``base_commit``."""
    from sandboxes.policy import check_image, check_repo_source
    from tasks.swe import test_log

    check_sandbox(instance)
    if isinstance(instance.get("image"), str) and not (instance.get("sandbox") or {}).get("image"):
        check_image(instance["image"], "instance.image", lexical=True)
    if instance.get("repo_source") is not None:
        check_repo_source(instance["repo_source"], "instance.repo_source", lexical=True)
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        test_log.test_list(instance.get(key), f"instance.{key}")
    commit = instance.get("base_commit")
    if not isinstance(commit, str) or not _COMMIT.match(commit):
        raise InvalidRequest("base_commit must be a full commit id (40 hex digits)",
                             field="instance.base_commit")
