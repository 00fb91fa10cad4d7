"""What the SWE forgery suites share: a real row as a SWE instance in a built environment, and
model patches made by editing its checkout (a patch as git writes it, the checkout reset after)."""
from __future__ import annotations

import subprocess
from pathlib import Path

from tests.real import swebench_data

NOOP = "\n# prorl: a comment, nothing else\n"


def make_patch(work: Path, base: str, changes: dict[str, str]) -> str:
    """The diff against ``base`` that ``changes`` make: path -> text appended to the file, or,
    with a leading ``=``, the file's whole new text."""
    for path, text in changes.items():
        target = work / path
        target.parent.mkdir(parents=True, exist_ok=True)
        old = "" if text.startswith("=") or not target.exists() else target.read_text()
        target.write_text(old + text.removeprefix("="))
    swebench_data._git(work / ".git", "add", "-A", "-f", ".", work=work)
    patch = swebench_data._git(work / ".git", "diff", "--cached", base, work=work).decode()
    swebench_data._git(work / ".git", "reset", "-q", "--hard", base, work=work)
    subprocess.run(["git", "-C", str(work), "clean", "-qfdx"], check=True)
    return patch


def row_with_forgeries(tmp_path_factory, row_id: str, forgeries: dict[str, dict[str, str]],
                       noop_path: str) -> tuple[dict, dict[str, str]]:
    """The row as a SWE instance (its environment built or found), and its forged patches, with a
    no-op patch (a comment added to ``noop_path``) under ``(no-op)``."""
    from sandboxes.runtimes.env.build import ensure_env
    from tests.real.test_swebench import recipe_of

    row = swebench_data.rows()[row_id]
    work = swebench_data.materialize(row, tmp_path_factory.mktemp(f"forgery-{row_id}") / row_id)
    image = ensure_env(recipe_of(row_id, work))
    instance = {**row, "data_source": "swebench", "repo_source": str(work), "image": str(image)}
    forged = {name: make_patch(work, row["base_commit"], changes) for name, changes in forgeries.items()}
    forged["(no-op)"] = make_patch(work, row["base_commit"], {noop_path: NOOP})
    return instance, forged
