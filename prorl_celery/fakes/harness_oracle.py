"""The fake LLM's oracle for harnesses (a test and demo tool, not a model): it plays the fixture
tasks in each harness's own format, as the harness's prompt shows it.

mini-swe-agent (its instance template asks for ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``):
the SWE fixture's steps as ``bash`` tool calls with a ``command``, then that echo. Anything else
goes to :func:`prorl_celery.fakes.oracle.reply`.

Start a fake server with it: ``prorl-celery fake-llm --policy oracle:prorl_celery.fakes.harness_oracle:reply``.
"""
from __future__ import annotations

from typing import Any

from prorl_celery.fakes import oracle
from prorl_celery.fakes.llm.policies import Reply

MINI_SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def _mini(messages: list[dict[str, Any]], text: str) -> Reply | None:
    step = oracle._step(messages)
    for task in oracle._swe_tasks():
        if task["problem_statement"] in text:
            answer = oracle._swe(task, step)
            if answer.tool_calls and answer.tool_calls[0].name == "submit":
                return oracle._call("bash", command=f"echo {MINI_SUBMIT}")
            return answer
    return None


def reply(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Reply | None:
    text = oracle._first_user(messages)
    if MINI_SUBMIT in text:
        return _mini(messages, text)
    return oracle.reply(messages, tools)
