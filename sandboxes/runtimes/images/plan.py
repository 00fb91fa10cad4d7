"""What a parsed Dockerfile means (pure): its stages, each a base and a list of steps with every
variable already substituted, and the image config the last stage leaves.

Everything a Dockerfile says is known before anything runs: ARG values (declared defaults,
``--build-arg`` values, global ARGs before the first FROM usable in FROM lines and, once
re-declared, in a stage), ENV values (the base image's own first), WORKDIR, USER and SHELL. So
each RUN step carries its exact argv, environment (ARGs in scope, then ENV over them) and working
directory, and each COPY/ADD step its sources and absolute destination.

Honoured: FROM (``AS name``, a previous stage as base, ``scratch``), RUN (shell and exec forms,
heredocs, ``--network=none|default|host``, ``--mount=type=cache`` as a plain directory), COPY and
ADD (``--from=<stage or image>``, ``--chown``, ``--chmod``, heredocs; ADD's URLs and local tar
archives in the builder), ENV, ARG, WORKDIR, SHELL. Recorded as metadata in the image's config,
not acted upon by the build: CMD, ENTRYPOINT, EXPOSE, LABEL, MAINTAINER (a label), VOLUME,
STOPSIGNAL, HEALTHCHECK, ONBUILD (kept, never run: no build starts FROM a built image here), and
USER (recorded; the build's RUN lines and the sandboxes run as root; a note says so). Refused with
an error naming the line: RUN ``--mount`` other than a cache, ``--security``, COPY ``--parents``
and ``--exclude``, ADD ``--keep-git-dir``, any other flag, SHELL not in JSON form.
"""
from __future__ import annotations

import posixpath
from typing import Callable, Literal

from prorl_celery.errors import ImageBuildFailed
from sandboxes.runtimes.images.dockerfile import Dockerfile, Instruction, fail, parse
from sandboxes.runtimes.images.stages import DEFAULT_PATH, ImageConfig, Plan, Stage, Step
from sandboxes.runtimes.images.words import heredoc_text, word, words

__all__ = ["DEFAULT_PATH", "ImageConfig", "Plan", "Stage", "Step", "plan"]

PLATFORM_ARGS = {"TARGETPLATFORM": "linux/amd64", "TARGETOS": "linux", "TARGETARCH": "amd64", "TARGETVARIANT": "",
                 "BUILDPLATFORM": "linux/amd64", "BUILDOS": "linux", "BUILDARCH": "amd64", "BUILDVARIANT": ""}
ALLOWED_FLAGS = {"FROM": {"platform"}, "RUN": {"mount", "network"}, "COPY": {"from", "chown", "chmod", "link"},
                 "ADD": {"chown", "chmod", "checksum", "link"},
                 "HEALTHCHECK": {"interval", "timeout", "start-period", "start-interval", "retries"}}


BaseEnv = Callable[[str], dict[str, str]]


def _no_base_env(ref: str) -> dict[str, str]:
    return {"PATH": DEFAULT_PATH}


class _Planner:
    def __init__(self, dockerfile: Dockerfile, build_args: dict[str, str], base_env: BaseEnv):
        self.escape = dockerfile.escape
        self.build_args = build_args
        self.base_env = base_env
        self.global_args: dict[str, str | None] = dict(PLATFORM_ARGS)
        self.used_args: set[str] = set()
        self.stages: list[Stage] = []
        self.stage: Stage | None = None
        self.args: dict[str, str | None] = {}

    # -- lookups ---------------------------------------------------------------------------
    def lookup(self, name: str) -> str | None:
        if self.stage is None:
            return self.global_args.get(name)
        if name in self.stage.env:
            return self.stage.env[name]
        return self.args.get(name)

    def word(self, text: str, ins: Instruction) -> str:
        return word(text, self.lookup, self.escape, ins.where)

    def words(self, text: str, ins: Instruction) -> list[str]:
        return words(text, self.lookup, self.escape, ins.where)

    # -- instructions ----------------------------------------------------------------------
    def run(self, dockerfile: Dockerfile) -> Plan:
        for ins in dockerfile.instructions:
            unknown = set(ins.flags) - ALLOWED_FLAGS.get(ins.cmd, set())
            if unknown:
                raise fail(ins.where, f"flag --{sorted(unknown)[0]} is not supported by this builder")
            if ins.cmd == "FROM":
                self.from_(ins)
            elif ins.cmd == "ARG":
                self.arg(ins)
            elif self.stage is None:
                raise fail(ins.where, "only ARG may come before the first FROM")
            else:
                getattr(self, f"i_{ins.cmd.lower()}", self.metadata)(ins)
        if not self.stages:
            raise fail("(whole file)", "no FROM instruction")
        unused = sorted(set(self.build_args) - self.used_args)
        notes = [f"build args never declared by an ARG: {', '.join(unused)}"] if unused else []
        return Plan(stages=self.stages, needed=self.needed(len(self.stages) - 1), notes=notes)

    def needed(self, target: int) -> list[int]:
        seen, todo = set(), [target]
        while todo:
            index = todo.pop()
            if index in seen:
                continue
            seen.add(index)
            stage = self.stages[index]
            todo += [i for i in [stage.base_stage, *(s.from_stage for s in stage.steps)] if i is not None]
        return sorted(seen)

    def arg(self, ins: Instruction) -> None:
        for name, has_default, default in self._arg_items(ins):
            if name in self.build_args:
                value: str | None = self.build_args[name]
                self.used_args.add(name)
            elif has_default:
                value = default
            else:
                value = self.global_args.get(name) if self.stage is not None else None
            (self.args if self.stage is not None else self.global_args)[name] = value

    def _arg_items(self, ins: Instruction) -> list[tuple[str, bool, str]]:
        items = []
        for raw in _split_top(ins.args):
            name, eq, default = raw.partition("=")
            if not name or not name.replace("_", "a").isalnum():
                raise fail(ins.where, f"bad ARG name {name!r}")
            items.append((name, bool(eq), self.word(default, ins) if eq else ""))
        if not items:
            raise fail(ins.where, "ARG needs a name")
        return items

    def from_(self, ins: Instruction) -> None:
        parts = words(ins.args, self.global_args.get, self.escape, ins.where)
        if len(parts) not in (1, 3) or (len(parts) == 3 and parts[1].lower() != "as"):
            raise fail(ins.where, "FROM takes an image and optionally 'AS <name>'")
        ref, name = parts[0], (parts[2].lower() if len(parts) == 3 else None)
        notes = []
        platform = ins.flags.get("platform")
        if platform and word(platform, self.global_args.get, self.escape, ins.where) not in ("linux/amd64", "linux/x86_64"):
            notes.append(f"FROM --platform={platform} at line {ins.line}: built for this node's platform")
        by_name = {s.name: s for s in self.stages if s.name}
        base = by_name.get(ref.lower())
        stage = Stage(index=len(self.stages), line=ins.line, name=name, from_ref=ref, notes=notes)
        if base is not None:
            stage.base_stage, stage.env, stage.workdir = base.index, dict(base.env), base.workdir
            stage.user, stage.config = base.user, base.config.model_copy(deep=True)
        elif ref != "scratch":
            try:
                stage.env = dict(self.base_env(ref))
            except ImageBuildFailed as exc:
                raise fail(ins.where, str(exc)) from None
        self.stages.append(stage)
        self.stage, self.args = stage, {}

    def i_run(self, ins: Instruction) -> None:
        network = _run_network(ins)
        shell = self.stage.config.shell
        argv, script = ins.exec_form(), None
        if ins.heredocs and argv is None:
            only = ins.args.strip().lstrip("<-").strip("\"'") == ins.heredocs[0].name and len(ins.heredocs) == 1
            if only and ins.heredocs[0].body.startswith("#!"):
                script = ins.heredocs[0].body
            elif only:
                argv = [*shell, ins.heredocs[0].body]
            else:
                text = ins.args + "\n" + "".join(f"{d.body}{d.name}\n" for d in ins.heredocs)
                argv = [*shell, text]
        elif argv is None:
            argv = [*shell, ins.args]
        if self.stage.user not in (None, "root", "0", "0:0", "root:root"):
            self._note(f"RUN at line {ins.line} ran as root, not as USER {self.stage.user}")
        env = {k: v for k, v in self.args.items() if v is not None}
        env.update(self.stage.env)
        env.setdefault("PATH", DEFAULT_PATH)
        if "mount" in ins.flags:
            self._note(f"RUN --mount at line {ins.line}: the cache directory is part of the image")
        self.stage.steps.append(Step(kind="run", line=ins.line, where=ins.where, argv=argv or [], script=script,
                                     env=env, network=network, workdir=self.stage.workdir))

    def i_copy(self, ins: Instruction) -> None:
        self._copy(ins, "copy")

    def i_add(self, ins: Instruction) -> None:
        self._copy(ins, "add")

    def _copy(self, ins: Instruction, kind: Literal["copy", "add"]) -> None:
        listed = ins.exec_form()
        parts = [word(p, self.lookup, self.escape, ins.where) for p in listed] if listed is not None \
            else self.words(ins.args, ins)
        inline = {d.name: heredoc_text(d, self.lookup, self.escape, ins.where) for d in ins.heredocs}
        sources = [p for p in parts[:-1] if not (p.startswith("<<") and p.lstrip("<-").strip("\"'") in inline)]
        if len(parts) < 2 and not inline or not parts:
            raise fail(ins.where, f"{ins.cmd} needs a source and a destination")
        dest = parts[-1]
        absolute = posixpath.normpath(posixpath.join(self.stage.workdir, dest))
        if dest.endswith(("/", "/.")) or dest in (".", ".."):
            absolute = absolute.rstrip("/") + "/"
        step = Step(kind=kind, line=ins.line, where=ins.where, sources=sources, inline=inline, dest=absolute,
                    workdir=self.stage.workdir, chmod=ins.flags.get("chmod"), checksum=ins.flags.get("checksum"),
                    chown=self.word(ins.flags["chown"], ins) if "chown" in ins.flags else None)
        if "from" in ins.flags:
            source = self.word(ins.flags["from"], ins)
            by_name = {s.name: s.index for s in self.stages[:-1] if s.name}
            if source.lower() in by_name:
                step.from_stage = by_name[source.lower()]
            elif source.isdigit() and int(source) < len(self.stages) - 1:
                step.from_stage = int(source)
            else:
                step.from_image = source
        if step.chmod and not _octal(step.chmod):
            raise fail(ins.where, f"--chmod={step.chmod}: only octal modes are supported")
        self.stage.steps.append(step)

    def i_env(self, ins: Instruction) -> None:
        self.stage.env.update(self._pairs(ins))

    def i_workdir(self, ins: Instruction) -> None:
        path = self.word(ins.args, ins)
        if not path:
            raise fail(ins.where, "WORKDIR needs a path")
        self.stage.workdir = posixpath.normpath(posixpath.join(self.stage.workdir, path))
        self.stage.steps.append(Step(kind="workdir", line=ins.line, where=ins.where, workdir=self.stage.workdir))

    def i_user(self, ins: Instruction) -> None:
        self.stage.user = self.word(ins.args, ins) or None

    def i_shell(self, ins: Instruction) -> None:
        shell = ins.exec_form()
        if not shell:
            raise fail(ins.where, 'SHELL must be written as a JSON array, e.g. ["/bin/bash", "-c"]')
        self.stage.config.shell = shell

    def metadata(self, ins: Instruction) -> None:
        config = self.stage.config
        if ins.cmd in ("CMD", "ENTRYPOINT"):
            value = ins.exec_form()
            setattr(config, ins.cmd.lower(), value if value is not None else [*config.shell, ins.args])
        elif ins.cmd == "EXPOSE":
            config.expose += self.words(ins.args, ins)
        elif ins.cmd == "LABEL":
            config.labels.update(self._pairs(ins))
        elif ins.cmd == "MAINTAINER":
            config.labels["maintainer"] = ins.args
        elif ins.cmd == "VOLUME":
            config.volumes += ins.exec_form() or self.words(ins.args, ins)
        elif ins.cmd == "STOPSIGNAL":
            config.stopsignal = self.word(ins.args, ins)
        elif ins.cmd == "HEALTHCHECK":
            config.healthcheck = {"test": ins.exec_form() or ins.args, **ins.flags}
        elif ins.cmd == "ONBUILD":
            config.onbuild.append(ins.args)

    # -- helpers ---------------------------------------------------------------------------
    def _pairs(self, ins: Instruction) -> dict[str, str]:
        first = ins.args.split(None, 1)
        if not first:
            raise fail(ins.where, f"{ins.cmd} needs a name and a value")
        if "=" not in first[0]:  # the legacy form: ENV NAME the rest is the value
            if len(first) < 2:
                raise fail(ins.where, f"{ins.cmd} {first[0]} has no value")
            return {first[0]: self.word(first[1], ins)}
        out = {}
        for item in self.words(ins.args, ins):
            name, eq, value = item.partition("=")
            if not eq or not name:
                raise fail(ins.where, f"{ins.cmd} {item!r} is not name=value")
            out[name] = value
        return out

    def _note(self, text: str) -> None:
        if text not in self.stage.notes:
            self.stage.notes.append(text)


def _split_top(text: str) -> list[str]:
    """ARG's items: split on whitespace outside quotes (each item's value is expanded later)."""
    out, current, quote = [], [], ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch.isspace():
            if current:
                out.append("".join(current))
            current = []
            continue
        current.append(ch)
    if current:
        out.append("".join(current))
    return out


def _run_network(ins: Instruction) -> bool | None:
    mount = ins.flags.get("mount")
    if mount is not None and "type=cache" not in mount.split(","):
        raise fail(ins.where, f"RUN --mount={mount}: only type=cache mounts are supported")
    network = ins.flags.get("network")
    if network is None or network in ("default", "host"):
        return None
    if network == "none":
        return False
    raise fail(ins.where, f"RUN --network={network}: give none, default or host")


def _octal(mode: str) -> bool:
    return bool(mode) and all(c in "01234567" for c in mode) and len(mode) <= 4


def plan(text: str, build_args: dict[str, str] | None = None, base_env: BaseEnv = _no_base_env) -> Plan:
    """The stages and steps of a Dockerfile's ``text`` (see the module doc); ``base_env`` gives
    the environment an external FROM image starts with."""
    dockerfile = parse(text)
    return _Planner(dockerfile, dict(build_args or {}), base_env).run(dockerfile)
