"""The task sets we ship, as the audit reads them (issue 34 item 4): JSONL files of instances.

    python3 -m bench.audit_sets builtin OUT_DIR   # one instance or more of every built-in domain
    python3 -m bench.audit_sets swe OUT_DIR [ID...]   # the vendored SWE-bench rows, environments built

``builtin`` writes ``OUT_DIR/builtin.jsonl``: math, STEM, echo, lookup, code (Python tests and
stdin/stdout cases), HumanEval, shell, and every fake SWE fixture (``prorl_celery/fakes/swe``, its
repository under ``OUT_DIR/repos``). ``swe`` writes ``OUT_DIR/swe.jsonl``: each row of
``tests/fixtures/swebench`` with its repository materialized under ``OUT_DIR/repos`` and its
environment built (or found built) on this node, one at a time. The stack must allow
``OUT_DIR/repos`` (``PRORL_REPO_SOURCE_DIRS``) and the environments' directory
(``PRORL_SANDBOX_IMAGE_DIRS``). The paths of the files written are printed."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def builtin(out: Path) -> list[dict[str, Any]]:
    from prorl_celery.fakes import swe
    from prorl_celery.fakes.problems import MATH, STEM

    rows: list[dict[str, Any]] = [
        {"data_source": "math", **MATH[0]},
        {"data_source": "stem", **STEM[0]},
        {"data_source": "echo", "instance_id": "echo-contains", "text": "48213", "match": "contains", "tools": "none"},
        {"data_source": "echo", "instance_id": "echo-submit", "text": "good morning", "tools": "submit"},
        {"data_source": "lookup", "instance_id": "lookup-3", "files": {"a.txt": "the code is 41872\n",
                                                                     "b.txt": "the code is 90315\n",
                                                                     "c.txt": "the code is 27764\n"},
         "target": "b.txt", "code": "90315"},
        {"data_source": "code", "instance_id": "code-python", "prompt": "Write add(a, b) returning a + b.",
         "entry_point": "add", "tests": "def check(candidate):\n    assert candidate(2, 3) == 5\n"
                                        "    assert candidate(-1, 1) == 0\n"},
        {"data_source": "code", "instance_id": "code-io", "prompt": "Read two integers, print their sum.",
         "tests": [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6\n"}]},
        {"data_source": "humaneval", "task_id": "HumanEval/0"},
        {"data_source": "shell", "instance_id": "shell-ok", "commands": ["true"]},
    ]
    rows += [{**swe.build(name, out / "repos"), "instance_id": f"fake-swe-{name}"} for name in swe.names()]
    return rows


def swe_rows(out: Path, ids: list[str]) -> list[dict[str, Any]]:
    from sandboxes.runtimes.env.build import ensure_env
    from tests.real import swebench_data
    from tests.real.test_swebench import recipe_of

    rows = swebench_data.rows()
    made = []
    for iid in ids or list(rows):
        started = time.monotonic()
        repo = swebench_data.materialize(rows[iid], out / "repos" / iid)
        image = ensure_env(recipe_of(iid, repo))
        print(f"{iid}: environment {image} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
        made.append({**rows[iid], "repo_source": str(repo), "image": str(image)})
    return made


def main(argv: list[str]) -> None:
    what, out, rest = argv[0], Path(argv[1]).resolve(), argv[2:]
    out.mkdir(parents=True, exist_ok=True)
    rows = builtin(out) if what == "builtin" else swe_rows(out, rest)
    path = out / f"{what}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(path)


if __name__ == "__main__":
    main(sys.argv[1:])
