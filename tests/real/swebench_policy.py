"""Scripted agents for the real SWE-bench rows (test tools, played by the fake LLM server).

``reply`` is an oracle (``--policy oracle:tests.real.swebench_policy:reply``): it finds the row
whose problem statement opens the conversation and applies the row's gold patch with ``git
apply`` in one bash call, then submits. :data:`EMPTY` submits at once; :data:`NOOP` appends a
comment to the first tracked Python file outside the tests and dot-directories and submits (a patch that changes
nothing the tests see).
"""
from __future__ import annotations

import functools
from typing import Any

from prorl_celery.llm.chatml import text_of
from prorl_celery.fakes.llm.policies import Reply, ReplyCall
from tests.real import swebench_data

EOF_MARK = "PRORL_GOLD_EOF"
EMPTY = [{"tool_calls": [{"name": "submit", "arguments": {}}]}]
NOOP_EDIT = ("f=$(git ls-files '*.py' | grep -v -i -E '(^|/)(tests?|testing)/|test_|_test\\.py|conftest|(^|/)\\.' | head -1) "
             "&& printf '\\n# prorl: a comment, nothing else\\n' >> \"$f\" && git status --short")
NOOP = [{"tool_calls": [{"name": "bash", "arguments": {"command": NOOP_EDIT}}]},
        {"tool_calls": [{"name": "submit", "arguments": {}}]}]


@functools.cache
def _rows() -> list[dict[str, Any]]:
    return list(swebench_data.rows().values())


def _call(name: str, **arguments: Any) -> Reply:
    return Reply(content="", tool_calls=[ReplyCall(name=name, arguments=arguments)])


def gold_command(patch: str) -> str:
    if EOF_MARK in patch:
        raise ValueError("the gold patch contains the heredoc marker")
    return (f"cat > /tmp/gold.patch <<'{EOF_MARK}'\n{patch}{'' if patch.endswith(chr(10)) else chr(10)}{EOF_MARK}\n"
            "git apply --whitespace=nowarn /tmp/gold.patch && git status --short")


def reply(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Reply | None:
    first = next((text_of(m.get("content")) for m in messages if m.get("role") == "user"), "")
    step = sum(1 for m in messages if m.get("role") == "assistant")
    for row in _rows():
        if row["problem_statement"] in first:
            return _call("bash", command=gold_command(row["patch"])) if step == 0 else _call("submit")
    return None
