"""``replay``: a kept result's final workspace restored as the agent, so that today's grader grades
what an earlier rollout left (``prorl-celery rescore``). It makes no LLM call; what it restores goes
in as files, not on the command line.

Three forms: ``"patch"``, a git diff of the working tree (a SWE result's ``git_patch``), applied in
the task's working directory; ``"workspaces"``, a Harbor result's kept steps
(:mod:`tasks.harbor.keep`): on its n-th launch in a sandbox (the n-th step) it deletes the files
and symlinks under the step's directories that the kept tree did not hold, then unpacks the
step's diff at ``/``, with the sandbox's ``python3`` (which every harness's forwarder needs);
``"final_text"`` (and ``"answer"``), an answer domain's stored answer, which the run then holds
as its harness's last message (and submit answer) for a grader that needs a sandbox (``code``)."""
from __future__ import annotations

import base64
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tasks.harnesses.base import HARNESS_DIR, HarnessTask, Launch

MAX_BYTES = 64 * 1024 * 1024
STEP_MARK = "/tmp/.prorl-replay-step"  # outside every carried directory: never graded

RESTORE = f'''import base64, gzip, io, json, os, sys, tarfile
d = os.environ["PRORL_HARNESS_DIR"]
root = sys.argv[1] if len(sys.argv) > 1 else "/"  # "/" in a sandbox; a folder standing for it in a test
mark = os.path.join(root, "{STEP_MARK}".lstrip("/"))
n = int(open(mark).read()) if os.path.exists(mark) else 0
open(mark, "w").write(str(n + 1))
if not os.path.exists(os.path.join(d, "ws%d.json" % n)):
    sys.exit("replay: no kept workspace for step %d" % n)
ws = json.load(open(os.path.join(d, "ws%d.json" % n)))
keep = set(ws["names"])
for top in ws["dirs"]:
    for base, dirs, files in os.walk(os.path.join(root, top.lstrip("/"))):
        for name in files + [x for x in dirs if os.path.islink(os.path.join(base, x))]:
            if "/" + os.path.relpath(os.path.join(base, name), root) not in keep:
                os.unlink(os.path.join(base, name))
data = gzip.decompress(base64.b64decode(open(os.path.join(d, "ws%d.b64" % n)).read()))
with tarfile.open(fileobj=io.BytesIO(data)) as tar:
    if hasattr(tarfile, "fully_trusted_filter"):
        tar.extractall(root, filter="fully_trusted")  # the host built its names: relative, no ..
    else:
        tar.extractall(root)
    unpacked = len(tar.getmembers())
print("replay: step %d restored: %d files present, %d members unpacked" % (n, len(keep), unpacked))
'''


class ReplayWorkspace(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tar_gz: str = Field(max_length=MAX_BYTES, description="Base64 of the gzip-compressed tar of the files that "
                                                          "differ from the task's image (names relative to /).")
    dirs: list[str] = Field(description="The directories the step's verifier got (the working directory first).")
    names: list[str] = Field(description="Every file and symlink those directories held (absolute).")


class ReplayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    patch: str | None = Field(None, max_length=MAX_BYTES, description="A git diff of the working tree, applied in "
                                                                      "the task's working directory.")
    workspaces: list[ReplayWorkspace] | None = Field(None, description="A Harbor result's kept workspace per step, "
                                                                       "restored one per launch.")
    final_text: str | None = Field(None, max_length=MAX_BYTES, description="An answer domain's stored last "
                                   "message, the rollout's final text (its grader needs a sandbox: code).")
    answer: str | None = Field(None, max_length=MAX_BYTES, description="With final_text: the stored submit answer.")

    @model_validator(mode="after")
    def _one(self) -> "ReplayConfig":
        if sum(x is not None for x in (self.patch, self.workspaces, self.final_text)) != 1:
            raise ValueError("replay takes one of patch, workspaces or final_text")
        if self.answer is not None and self.final_text is None:
            raise ValueError("replay's answer goes with final_text")
        return self


def workspaces_of(kept: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``workspaces`` of a replay from :func:`tasks.harbor.keep.load`'s steps."""
    return [{"tar_gz": base64.b64encode(ws["tar_gz"]).decode(), "dirs": ws["dirs"], "names": ws["names"]}
            for _, ws in sorted(kept.items())]


class Replay:
    name = "replay"
    config_class = ReplayConfig

    def stored_answer(self, config: ReplayConfig) -> tuple[str | None, str] | None:
        """(the submit answer, the final text) this replay stands for; None: not an answer replay."""
        return None if config.final_text is None else (config.answer, config.final_text)

    def launch(self, task: HarnessTask, config: ReplayConfig) -> Launch:
        if config.final_text is not None:  # the answer is the rollout's: nothing runs in the sandbox
            return Launch(command="true")
        if config.workspaces is not None:
            files = {"restore.py": RESTORE}
            for i, ws in enumerate(config.workspaces):
                files[f"ws{i}.b64"] = ws.tar_gz
                files[f"ws{i}.json"] = json.dumps({"dirs": ws.dirs, "names": ws.names})
            return Launch(files=files, command=f'python3 -I "{HARNESS_DIR}/restore.py"')
        command = (f'if [ -s "{HARNESS_DIR}/patch.diff" ]; then git apply --whitespace=nowarn '
                   f'"{HARNESS_DIR}/patch.diff" || patch -p1 --forward < "{HARNESS_DIR}/patch.diff"; fi')
        return Launch(files={"patch.diff": config.patch or ""}, command=command)

    def finish_reason(self, exit_code: int | None, output: str) -> str | None:
        return "exited" if exit_code == 0 else None
