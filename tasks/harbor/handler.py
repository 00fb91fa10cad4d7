"""``harbor``: a Harbor task folder, ``{"data_source": "harbor", "task_dir": ..., "agent": {...}}``.

init builds the task's image (:mod:`sandboxes.runtimes.images.build`: its Dockerfile made a
rootfs without a Docker daemon, once per content hash) and opens the agent's sandbox on it with a
writable root, the task's working directory, env, resources and network (the task asks; the
operator's ``harbor_allow_internet`` grants), starts the task's sidecar services
(:mod:`tasks.harbor.sidecars`) before anything of the task runs in it, then prepares the first step
(the jobs of a group start on one prepared root: :mod:`tasks.harbor.fork`). run runs the
instance's agent (the built-in one, or any harness: ``oracle`` runs the step's ``solve.sh``) on
each step's instruction and grades each step as it ends, while the agent's sandbox is the stage's
own (a ``min_reward`` a step misses ends the task); eval rolls the steps' rewards up
(``multi_step_reward_strategy``: mean or final).

Grading (:mod:`tasks.harbor.verifier`): the agent's changes beneath the working directory, taken
by the agent's sandbox host, go into a FRESH sandbox of the image with the step's tests; the
reward is read from what ``test.sh`` wrote there once every process in it is dead. Harbor's
"shared" mode (grading in the agent's own sandbox) only where the operator opts in
(``harbor_shared_verifier``); ``harbor.mode`` says which graded.
"""
from __future__ import annotations

import os
import shlex
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

from config.settings import get_settings, rescore_retention_s
from prorl_celery.errors import InvalidRequest
from sandboxes.base import SandboxSpec
from sandboxes.dirs import split_dirs
from tasks.agent.runner import runner_for
from tasks.context import StageContext
from tasks.handlers.agentic import AgentTaskHandler
from tasks.handlers.instances import check_harbor, harbor_sandbox_need
from tasks.harbor import boxes, files, fork, keep, sidecars
from tasks.harbor.config import wants_internet
from tasks.harbor.task import HarborTask, Step, load
from tasks.harbor import tools, verifier

KEY = "harbor"
SYSTEM = ("You are an autonomous agent in a Linux shell. Complete the task below by running commands "
          "with the bash tool and editing files. Work in the current directory unless the task says "
          "otherwise. When the task is done, call submit (with no answer).")


@lru_cache(maxsize=64)
def _task(task_dir: str, mtime: float) -> HarborTask:
    return load(task_dir)


def task_of(instance: dict[str, Any]) -> HarborTask:
    import os

    path = instance.get("task_dir")
    if not isinstance(path, str):
        raise InvalidRequest("a harbor instance needs task_dir (a Harbor task folder)", field="instance.task_dir")
    try:
        mtime = os.stat(os.path.join(path, "task.toml")).st_mtime
    except OSError:
        mtime = 0.0
    return _task(path, mtime)


class HarborHandler(AgentTaskHandler):
    name = "harbor"
    default_sandbox = {"limits": {"memory_mb": 4096, "disk_mb": 8192, "pids": 1024}}

    def check_instance(self, instance: dict[str, Any]) -> None:
        """The folder is allowed and its task.toml honoured whole (:func:`check_harbor`)."""
        check_harbor(instance)

    def sandbox_need(self, instance: dict[str, Any]) -> int:
        """The agent's sandbox, its sidecars' and the verifier's (:func:`harbor_sandbox_need`)."""
        return harbor_sandbox_need(instance)

    # -- what the agent gets -----------------------------------------------------------------
    def _block(self, ctx: StageContext) -> dict[str, Any]:
        return ctx.state.setdefault(KEY, {})

    def _step(self, ctx: StageContext) -> Step:
        return task_of(ctx.instance).steps[self._block(ctx).get("step", 0)]

    def prompt(self, ctx: StageContext) -> list[dict[str, Any]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.instruction(ctx)}]

    def instruction(self, ctx: StageContext) -> str:
        """The step's instruction; the first one with the skills appended for an agent that loads
        none (:mod:`tasks.harbor.tools`)."""
        block = self._block(ctx)
        extra = block.get("skills_appendix", "") if block.get("step", 0) == 0 else ""
        return self._step(ctx).instruction + extra

    def agent_tools(self, ctx: StageContext) -> Any:
        return tools.agent_tools(task_of(ctx.instance), self._block(ctx))

    # -- the sandboxes -----------------------------------------------------------------------
    def _image(self, ctx: StageContext, task: HarborTask) -> dict[str, Any]:
        """The task's image, built (or found built) now; its facts kept in the job's state."""
        from sandboxes.runtimes.images.build import ensure_built

        block = self._block(ctx)
        if block.get("image"):
            return block["image"]
        started = time.monotonic()
        env = task.config.environment
        dockerfile = task.environment / "Dockerfile"
        context = task.environment if dockerfile.is_file() else boxes.from_only(env.docker_image)
        built = ensure_built(context, timeout_s=env.build_timeout_sec)
        waited = time.monotonic() - started
        ctx.deadline += waited  # like an image pull: the build is waited out, not charged
        ctx.state.init_wait_s = round((ctx.state.init_wait_s or 0.0) + waited, 3)
        block["image"] = {"rootfs": built.rootfs, "key": built.key, "env": built.env, "workdir": built.workdir,
                          "entrypoint": built.config.entrypoint, "from": built.from_ref, "base": built.base,
                          "notes": built.notes, "build_s": round(waited, 3)}
        return block["image"]

    def _workdir(self, task: HarborTask, image: dict[str, Any]) -> str:
        return task.config.environment.workdir or image.get("workdir") or "/"

    @staticmethod
    def _own(task: HarborTask, image: dict[str, Any], workdir: str) -> list[str]:
        """What the task itself puts in its working directory (the image's, the steps' ``workdir/``):
        the verifier never counts these as the agent's shadowing modules."""
        dirs = [Path(image.get("rootfs") or "/nonexistent") / workdir.lstrip("/"),
                *(s.workdir_files for s in task.steps if s.workdir_files is not None)]
        names: set[str] = set()
        for folder in dirs:
            try:
                names.update(os.listdir(folder))
            except OSError:
                continue
        return sorted(names)

    def _spec(self, ctx: StageContext, task: HarborTask, image: dict[str, Any], network: bool,
              env: dict[str, str] | None = None) -> SandboxSpec:
        resources = task.config.environment
        limits = {k: v for k, v in (("cpus", resources.cpus), ("memory_mb", resources.memory_mb),
                                    ("disk_mb", resources.storage_mb)) if v is not None}
        block = {**(ctx.instance.get("sandbox") or {})}
        block["limits"] = {**limits, **(block.get("limits") or {})}
        base = self.sandbox_spec({**ctx.instance, "sandbox": block})
        return base.model_copy(update={
            "image": image["rootfs"], "writable_root": True, "workdir": self._workdir(task, image),
            # the image's own ENV the runtime takes from the image (etc/prorl-image.json), under these
            "network": network, "env": {**resources.env, **(task.compose.main_env if task.compose else {}),
                                        **(env or {}), **base.env}})

    def _agent_network(self, task: HarborTask) -> bool:
        return wants_internet(task.config, task.config.agent) and get_settings().harbor_allow_internet

    # -- init: the image, the agent's sandbox, the first step --------------------------------
    def init(self, ctx: StageContext) -> None:
        task = task_of(ctx.instance)
        image = self._image(ctx, task)
        online = self._agent_network(task)  # then the registries as the verifier reaches them (the toolkit)
        block = self._block(ctx)
        step, workdir = task.steps[block.get("step", 0)], self._workdir(task, image)
        spec = self._spec(ctx, task, image, online, env=boxes.tools_env(image) if online else None)
        forked = fork.prepared(ctx, task, block.get("step", 0), image, spec, lambda box: (
            boxes.entrypoint(box, image), boxes.setup(ctx, box, step, workdir)))  # once per group
        box = ctx.open_sandbox(fork.on_layer(spec, forked))
        if task.compose:  # before anything of the task runs in the agent's sandbox: depends_on
            block["services"] = sidecars.start(ctx, self, task, box)
        boxes.entrypoint(box, image)
        block.update(task=task.name, steps=[], step=block.get("step", 0), fork=forked,
                     network={"agent": online, "asked": wants_internet(task.config, task.config.agent)})
        tools.prepare(box, task, ctx.instance, block)
        self._prepare_step(ctx, box, task, step, image, prepared="layer" in forked)
        ctx.save()

    def _prepare_step(self, ctx: StageContext, box: Any, task: HarborTask, step: Step, image: dict[str, Any],
                      prepared: bool = False) -> None:
        mount = files.mount_of(box)
        if not prepared:  # a fork's root has the step's files and what setup.sh made (tasks/harbor/fork.py)
            boxes.setup(ctx, box, step, self._workdir(task, image))
        if step.solution is not None and getattr(boxes.harness_class(ctx.instance), "reads_solution", False):
            box.exec("rm -rf /solution", timeout=30)
            files.put_dirs(box, [step.solution], "/solution", mount=mount)
            env = task.config.solution.env
            if env:
                box.write_file(".prorl-solution-env", "".join(f"export {k}={shlex.quote(v)}\n"
                                                              for k, v in env.items()).encode())
                box.exec(f"mv {shlex.quote(mount + '/.prorl-solution-env')} /solution/.prorl-env", timeout=30)
        if step.healthcheck is not None:
            boxes.healthcheck(ctx, box, step)

    # -- run: the agent on each step, steps graded between ----------------------------------
    def run(self, ctx: StageContext) -> None:
        if ctx.resumed:
            ctx.sandbox.interrupt()
        ctx.admit()
        task = task_of(ctx.instance)
        block = self._block(ctx)
        image = block["image"]
        runner = runner_for(ctx.instance)
        while True:
            step = task.steps[block["step"]]
            outcome = runner.resume(ctx, self) if ctx.resumed else None
            ctx.resumed = False
            if outcome is None:
                with boxes.wall(ctx, step):
                    runner.run(ctx, self)
            ctx.save()
            last = block["step"] == len(task.steps) - 1
            if len(block["steps"]) <= block["step"]:  # graded while the agent's sandbox is the stage's
                block["steps"].append(self._grade(ctx, task, step, image, last=last))
                ctx.save()
            if last or block["steps"][-1].get("stopped"):
                return
            block["step"] += 1
            self._prepare_step(ctx, ctx.sandbox, task, task.steps[block["step"]], image)
            runner.next_task(ctx, self)
            ctx.save()

    def eval(self, ctx: StageContext) -> dict[str, Any]:
        task = task_of(ctx.instance)
        block = self._block(ctx)
        if len(block["steps"]) <= block["step"]:  # a run stage that ended before grading its step
            block["steps"].append(self._grade(ctx, task, task.steps[block["step"]], block["image"], last=True))
        rewards = verifier.roll_up(block["steps"], task.strategy())
        tampered = [s["name"] for s in block["steps"] if s.get("tampered")]
        reward = 0.0 if tampered or not rewards else verifier.headline(rewards)
        return {"reward": reward, "resolved": reward >= 1.0,
                "harbor": {**{k: v for k, v in block.items() if k not in ("steps", "skills_appendix")},
                           "rewards": rewards,
                           "strategy": task.strategy(), "tampered": tampered, "steps": block["steps"],
                           "grader_version": verifier.GRADER_VERSION}}  # the audit stamps its verdict with it

    # -- grading -------------------------------------------------------------------------------
    def _grade(self, ctx: StageContext, task: HarborTask, step: Step, image: dict[str, Any], last: bool) -> dict[str, Any]:
        """The step graded in a fresh sandbox of the image (or, in the operator's shared mode, in
        the agent's own), in the stage that ran the agent: its sandbox is alive and leased then
        (a job waiting for an eval worker holds no lease on it)."""
        settings = get_settings()
        started = time.monotonic()
        workdir = self._workdir(task, image)
        agent_box = ctx.sandbox
        artifacts = boxes.artifacts(agent_box, step)
        shared = task.config.verifier.environment_mode == "shared" and settings.harbor_shared_verifier
        timeout = max(1.0, min(step.verifier_timeout_s, ctx.remaining() - 5))
        carried = [p for p in [workdir, *split_dirs(settings.harbor_carry_paths)] if p != "/"]
        cap = settings.harbor_carry_max_mb * 1024 * 1024
        tar = agent_box.export_tree(carried, cap) if carried and not shared else b""
        # for prorl-celery rescore, before grading touches it (a shared verifier's workspace is the agent's)
        kept = self._keep(ctx, tar, carried, image,
                          export=(lambda: agent_box.export_tree(carried, cap)) if shared else None)
        if shared:
            box = agent_box
        else:
            network = wants_internet(task.config, task.config.verifier) and settings.harbor_verifier_network
            spec = self._spec(ctx, task, image, network, env=boxes.tools_env(image))
            box = ctx.open_aux_sandbox(spec)
            boxes.entrypoint(box, image)
            if tar:
                files.put_tar(box, tar, "/", mount=files.mount_of(box))
        try:
            box.exec("rm -rf /tests /logs/verifier && mkdir -p /tests /logs/verifier", timeout=30)
            files.put_dirs(box, step.tests, "/tests", mount=files.mount_of(box))
            with boxes.kept(agent_box):  # idle while graded: its lease would lapse
                graded = verifier.grade(box, step, workdir, timeout, shared=shared, own=self._own(task, image, workdir))
        finally:
            if not shared:
                ctx.close_aux_sandbox(box)
        graded.update(name=step.name, mode="shared" if shared else "separate", artifacts=artifacts,
                      grade_s=round(time.monotonic() - started, 3), kept=kept)
        why = verifier.min_reward_failure(graded["rewards"], step.min_reward)
        if why and not last:
            graded["stopped"] = why
        if task.config.verifier.environment_mode == "shared" and not shared:
            graded["mode_note"] = "the task asked for shared; graded separately (harbor_shared_verifier is off)"
        return graded

    def _keep(self, ctx: StageContext, tar: bytes, carried: list[str], image: dict[str, Any],
              export: Any = None) -> dict[str, Any]:
        """The step's workspace kept for re-grading (:mod:`tasks.harbor.keep`); what was kept.
        ``export``: how to take the tar when the verifier got none (shared mode)."""
        if not carried:
            return {"workspace": "no: the task's working directory is /"}
        try:
            if export is not None and rescore_retention_s(get_settings()) > 0:
                tar = export()
            return keep.keep(ctx.store.redis, ctx.job_id, self._block(ctx).get("step", 0), tar,
                             image.get("rootfs"), carried, get_settings())
        except Exception as exc:  # noqa: BLE001 - re-grading's copy never fails the job
            return {"workspace": f"no: {type(exc).__name__}: {exc}"[:300]}
