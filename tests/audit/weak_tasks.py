"""The weak-grader tasks (tests/audit/weak): one Harbor task per hack policy, assembled from the
shared environment, instruction and task.toml and the policy's own ``graders/<policy>.sh`` as its
test.sh (a ``# mode: shared`` line in it asks for Harbor's shared verifier)."""
from __future__ import annotations

import shutil
from pathlib import Path

WEAK = Path(__file__).resolve().parent / "weak"


def graders() -> list[str]:
    return sorted(p.stem for p in (WEAK / "graders").glob("*.sh"))


def assemble(root: Path, policy: str) -> Path:
    """The task whose grader is weak against ``policy``, as a folder beneath ``root``."""
    grader = (WEAK / "graders" / f"{policy}.sh").read_text()
    folder = root / policy
    shutil.copytree(WEAK / "environment", folder / "environment")
    (folder / "tests").mkdir()
    (folder / "tests" / "test.sh").write_text(grader)
    shutil.copy(WEAK / "environment" / "test_answer.py", folder / "tests" / "test_answer.py")
    shutil.copy(WEAK / "instruction.md", folder / "instruction.md")
    toml = (WEAK / "task.toml").read_text().replace('"prorl-audit/weak"', f'"prorl-audit/weak-{policy}"')
    if "# mode: shared" in grader:
        toml = toml.replace("[verifier]\n", '[verifier]\nenvironment_mode = "shared"\n')
    (folder / "task.toml").write_text(toml)
    return folder
