"""What a planned build is made of (:mod:`sandboxes.runtimes.images.plan` makes them): stages,
each a base and its steps with every variable substituted, and the image config it leaves."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_SHELL = ["/bin/sh", "-c"]


class Step(BaseModel):
    """One thing the builder does to a stage's root."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["run", "copy", "add", "workdir"]
    line: int
    where: str
    argv: list[str] = []  # run: what is executed
    script: str | None = None  # run: a heredoc with a shebang, written to a file and run
    env: dict[str, str] = {}  # run
    network: bool | None = None  # run: False for RUN --network=none
    workdir: str = "/"
    sources: list[str] = []  # copy/add: context paths (or stage/image paths with --from), URLs for add
    inline: dict[str, str] = {}  # copy/add heredocs: name -> content
    dest: str = ""  # copy/add: absolute destination; a trailing "/" means a directory
    from_stage: int | None = None
    from_image: str | None = None
    chown: str | None = None
    chmod: str | None = None
    checksum: str | None = None


class ImageConfig(BaseModel):
    """What the Dockerfile says of the image beyond its files (recorded, see the module doc)."""

    model_config = ConfigDict(extra="forbid")

    cmd: list[str] | None = None
    entrypoint: list[str] | None = None
    shell: list[str] = Field(default_factory=lambda: list(DEFAULT_SHELL))
    expose: list[str] = []
    labels: dict[str, str] = {}
    volumes: list[str] = []
    stopsignal: str | None = None
    healthcheck: dict | None = None
    onbuild: list[str] = []


class Stage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    index: int
    line: int = 0  # of its FROM
    name: str | None
    from_ref: str  # as written, variables substituted
    base_stage: int | None = None  # FROM <earlier stage>
    steps: list[Step] = []
    env: dict[str, str] = {}
    workdir: str = "/"
    user: str | None = None
    config: ImageConfig = Field(default_factory=ImageConfig)
    notes: list[str] = []


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stages: list[Stage]
    needed: list[int]  # the stages the last one needs, in build order
    notes: list[str] = []

    @property
    def target(self) -> Stage:
        return self.stages[-1]

    def external_refs(self) -> list[str]:
        """Every image the build needs that no stage makes (FROM and COPY --from)."""
        refs = []
        for index in self.needed:
            stage = self.stages[index]
            if stage.base_stage is None and stage.from_ref != "scratch":
                refs.append(stage.from_ref)
            refs += [step.from_image for step in stage.steps if step.from_image]
        return list(dict.fromkeys(refs))

    def where_used(self, ref: str) -> str:
        """Where the Dockerfile first names the external image ``ref``: "line 4 (COPY --from)"."""
        for index in self.needed:
            stage = self.stages[index]
            if stage.base_stage is None and stage.from_ref == ref:
                return f"line {stage.line} (FROM {ref})"
            for step in stage.steps:
                if step.from_image == ref:
                    return f"line {step.line} (COPY --from={ref})"
        return f"FROM {ref}"
