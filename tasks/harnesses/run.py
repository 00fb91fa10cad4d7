"""The run stage of a harness: a gateway session for the job, the harness started in the sandbox
against it, cancellation and budget watched while it runs, its calls saved on the job's rollout
as they complete (the built-in agent's records: the result reads them back the same way, and a
cancelled job's result has the calls made before the cancel).

The gateway runs in this worker (it generates through this worker's LLM pool) on a unix socket
with an unguessable name in ``gateway_socket_dir``, which bwrap binds into every sandbox read-only
and unlistable; a sandbox has no network, so its one way out is that socket. Inside, the
forwarder (:mod:`prorl_celery.gateway.forward`, run by the system's python3) listens on the
sandbox's own loopback and pipes to the socket; the harness is given ``http://127.0.0.1:<port>``
and the session's credential, which no other session's gateway accepts. The socket is node-local:
when the sandbox's host is on another node than this worker, the gateway also listens on this
node's address toward that host, and the host relays a socket of the same name in its own gateway
directory to it (:mod:`sandboxes.host.relay`). Which of the two is the sandbox provider's answer
(:meth:`sandboxes.provider.SandboxProvider.gateway_route`); ``state.harness["route"]`` keeps it."""
from __future__ import annotations

import base64
import logging
import os
import secrets
import shlex
import threading
import time
from pathlib import Path
from typing import Any, Callable

from config.settings import get_settings

from prorl_celery.errors import JobCancelled
from prorl_celery.gateway import Budget, CallLog, Gateway, GatewaySession, forward
from prorl_celery.jobstate import HARNESS_KEY
from prorl_celery.llm.models import SamplingParams
from prorl_celery.llm.pool import LLMPool
from sandboxes.base import ExecResult, gateway_dir
from tasks.context import StageContext
from tasks.harnesses import HARNESSES
from tasks.harnesses.base import HarnessSpec, HarnessTask, Launch
from tasks.harnesses.tools import AgentTools, report
from prorl_celery.rollout.results import STRICT_SAMPLING

log = logging.getLogger(__name__)
POLL_S = 0.2
EVAL_RESERVE_S = 10.0  # of the run stage's budget, kept for collecting the workspace afterwards
OUTPUT_TAIL = 4000


PORT = "@PRORL_GATEWAY_PORT@"  # in a launch's files: the forwarder's port, known once it listens
FORWARD = Path(forward.__file__).read_text()


def _install(ctx: StageContext, launch: Launch) -> None:
    """Put the launch's files, its command (``harness.sh``) and the forwarder in a fresh directory
    of the sandbox; ``$PRORL_HARNESS_DIR`` names it."""
    files = {**launch.files, "harness.sh": launch.command, "forward.py": FORWARD}
    steps = ["export PRORL_HARNESS_DIR=$(mktemp -d /tmp/prorl-harness.XXXXXX)"]
    for name, text in files.items():
        data = base64.b64encode(text.encode()).decode()
        steps.append(f"printf %s {data} | base64 -d > \"$PRORL_HARNESS_DIR\"/{shlex.quote(name)}")
    result = ctx.sandbox.exec(" && ".join(steps), timeout=60)
    if result.exit_code != 0:
        raise RuntimeError(f"could not put the harness's files in the sandbox: {result.output[-500:]}")


def _wrapped(socket_path: str) -> str:
    """The command that starts the forwarder, puts its port in the files, runs the harness and
    stops the forwarder; its exit status is the harness's."""
    d = '"$PRORL_HARNESS_DIR"'
    return (f"( python3 -I {d}/forward.py 0 {shlex.quote(socket_path)} {d}/port >{d}/forward.log 2>&1 & fwd=$!; "
            f"for i in $(seq 200); do [ -s {d}/port ] && break; sleep 0.05; done; "
            f"[ -s {d}/port ] || {{ echo 'gateway forwarder did not start:'; cat {d}/forward.log; kill $fwd; exit 125; }}; "
            f"sed -i \"s/{PORT}/$(cat {d}/port)/g\" $(ls -d {d}/* | grep -v forward.py); "
            f"bash {d}/harness.sh; rc=$?; kill $fwd 2>/dev/null; exit $rc )")


def _socket_path() -> str:
    directory = gateway_dir()
    if directory is None:
        raise RuntimeError(f"no gateway socket directory (settings.gateway_socket_dir: "
                           f"{get_settings().gateway_socket_dir!r}): a harness has no way to its gateway")
    return os.path.join(directory, f"{secrets.token_hex(16)}.sock")


def _cleanup(ctx: StageContext) -> None:
    """Remove the harness's files (they hold the session's credential); best effort."""
    try:
        ctx.sandbox.exec('rm -rf "$PRORL_HARNESS_DIR"; unset PRORL_HARNESS_DIR', timeout=30)
    except Exception as exc:  # noqa: BLE001 - a sandbox that is gone has nothing left to clean
        log.debug("job %s: harness cleanup skipped: %s", ctx.job_id, exc)


def _exec_watched(ctx: StageContext, command: str, timeout: float, session: GatewaySession,
                  log: CallLog) -> ExecResult | None:
    """Run ``command`` in the sandbox, saving each call the harness makes as it completes (with
    the job's state, in one fenced step); interrupt it (and abort its calls) once the job stops.
    None when it was cancelled."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = ctx.sandbox.exec(command, timeout=timeout)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the stage's thread
            box["error"] = exc
        finally:
            log.wake()

    thread = threading.Thread(target=target, name=f"harness-{ctx.job_id}", daemon=True)
    thread.start()
    while thread.is_alive():
        log.wait(POLL_S)
        try:
            log.flush()
            ended = ctx.stopped()
        except JobCancelled:  # the save found the job ended (its calls until then are stored)
            ended = True
        except BaseException:  # the store went away: stop the harness before the stage fails
            session.cancel()
            ctx.sandbox.interrupt()
            raise
        if ended and thread.is_alive():
            session.cancel()
            ctx.sandbox.interrupt()
            thread.join(30)
            return None
    if "error" in box:
        raise box["error"]
    return box["result"]


def trainer_sampling(params: dict[str, Any]) -> dict[str, Any]:
    """The job's sampling parameters, the set every call of its harness is sampled with: the
    trainer, not the harness, decides how the policy samples (a harness may only lower
    max_tokens and add stop strings: :mod:`prorl_celery.gateway.sampling`)."""
    return {k: v for k, v in (params or {}).items() if k in SamplingParams.model_fields and v is not None}


def run_harness(ctx: StageContext, instruction: str, pool: LLMPool | None = None,
                tools: AgentTools | None = None) -> dict[str, Any]:
    """Run the instance's harness on ``instruction`` (with the task's ``tools``, where it takes
    them) in the job's sandbox; its calls go on the job's rollout (:attr:`StageContext.transcript`),
    ``ctx.state.harness`` gets how it ended (``tools``: what it was given of them)."""
    spec = HarnessSpec.model_validate(ctx.instance["agent"])
    tools = tools or AgentTools()
    harness_cls = HARNESSES.load(spec.harness)
    harness = harness_cls()
    config = harness.config_class.model_validate(spec.own_config())
    wall = max(1.0, min(spec.wall_s or float("inf"), ctx.remaining() - EVAL_RESERVE_S))
    pool = pool or ctx.llm_pool(defer_release=True)
    session_id = f"{ctx.job_id}:{ctx.record.attempt}:{secrets.token_hex(4)}"
    started = time.monotonic()
    strict = (ctx.sampling_params or {}).get(STRICT_SAMPLING) is True
    sink = _Sink(ctx, started, strict)
    log = CallLog(sink, ctx.transcript)
    session = GatewaySession(session_id, lambda req, stop: pool.generate(ctx.job_id, req, should_stop=stop), log,
                             Budget(max_calls=spec.max_calls, max_tokens=spec.max_tokens, wall_s=wall),
                             stop=ctx.stopped, sampling=trainer_sampling(ctx.sampling_params),
                             after_answer=pool.send_releases, fence=ctx.staleness_fence())
    sink.session = session
    ctx.state.harness = _block(spec, session, started, strict)
    if tools:
        ctx.state.harness["tools"] = report(spec.harness, harness_cls, tools)
    ctx.save()  # a cancel from here on finds a harness's result in the state
    gateway = Gateway(session, token=secrets.token_urlsafe(24), model=spec.model, socket_path=_socket_path())
    try:
        route, socket_path = ctx.provider.gateway_route(ctx.sandbox, gateway.socket_path, gateway.listen_tcp,
                                                         gateway.relay_key)
    except BaseException:
        gateway.close()
        raise
    ctx.state.harness["route"] = route
    with gateway:
        task = HarnessTask(instruction=instruction, base_url=f"http://127.0.0.1:{PORT}", api_key=gateway.token,
                           socket_path=socket_path, model=spec.model, max_calls=spec.max_calls, wall_s=wall,
                           tools=tools)
        _install(ctx, harness.launch(task, config))
        try:
            result = _exec_watched(ctx, _wrapped(socket_path), wall, session, log)
        finally:
            _cleanup(ctx)
            if route == "relay":
                ctx.provider.close_gateway_route(ctx.sandbox, gateway.socket_path)
    session.fence_all()  # the session ended: what the result holds is within the bound, or masked
    if result is None:
        _keep(ctx, spec, session, None, "cancelled", started, strict)
        raise JobCancelled(f"job {ctx.job_id} was cancelled while its harness ran")
    reason = _finish_reason(harness, session, result)
    state = _keep(ctx, spec, session, result, reason, started, strict)
    stored = getattr(harness, "stored_answer", None)
    said = stored(config) if stored is not None else None
    if said is not None:  # the replay harness: a kept answer re-graded (prorl-celery rescore)
        state = ctx.state.harness = {**state, "answer": said[0], "final_text": said[1]}
    log.flush()  # the last calls, with the state that says how it ended
    return state


def restart_harness(ctx: StageContext, init: Callable[[], None]) -> None:
    """The run stage came again after its worker died while the harness ran: the harness's
    process and its gateway session went with that worker, and a harness cannot be resumed
    mid-session. It runs again from the start, in a fresh sandbox (``init``: the handler's, which
    closes the old one: its workspace holds what the first run changed), on a rollout started
    over: the result holds the calls of one session, never a lost one's beside it.
    ``harness.restarts`` counts these."""
    lost = ctx.state.pop(HARNESS_KEY, None) or {}
    ctx.state.harness_restarts = (ctx.state.harness_restarts or 0) + 1
    log.warning("job %s: its harness session %s was lost with its worker; running it again in a fresh sandbox",
                ctx.job_id, lost.get("session"))
    ctx.restart_transcript()
    init()


class _Sink:
    """The stage as the session log's sink (:class:`~prorl_celery.rollout.transcript.Sink`): each
    save carries the harness's block as it stands (on the stage's thread, under the log's lock)."""

    def __init__(self, ctx: StageContext, started: float, strict: bool):
        self.ctx, self.started, self.strict = ctx, started, strict
        self.session: GatewaySession | None = None  # set once the session is built on the log

    def save(self) -> None:
        self.ctx.state.harness = {**self.ctx.state.harness, **_running(self.session, self.started, self.strict)}
        self.ctx.save()


def _finish_reason(harness: Any, session: GatewaySession, result: ExecResult) -> str:
    if session.finish_reason:  # a budget the gateway enforced
        return session.finish_reason
    if result.timed_out:
        return "wall_time"
    if not session.history:
        return "no_llm_calls" if result.exit_code == 0 else "harness_error"
    return harness.finish_reason(result.exit_code, result.output) or "harness_error"


def _block(spec: HarnessSpec, session: GatewaySession, started: float, strict: bool) -> dict[str, Any]:
    """``state.harness`` while it runs: which harness, its session, its time so far."""
    return {"name": spec.harness, "session": session.session_id, "finish_reason": None, "exit_code": None,
            "output": "", **_running(session, started, strict)}


def _running(session: GatewaySession, started: float, strict: bool) -> dict[str, Any]:
    out = {"final_text": session.history[-1].turn.content if session.history else "",
           "run_s": round(time.monotonic() - started, 3), "llm_s": round(session.llm_s, 4),
           "gateway_s": round(session.gateway_s, 4), "sampling": {**session.sampling_report(), "strict": strict}}
    staleness = session.staleness()
    if staleness is not None:  # the fence's counts, as the built-in agent's state["agent"] holds them
        out["staleness"] = staleness
    return out


def _keep(ctx: StageContext, spec: HarnessSpec, session: GatewaySession, result: ExecResult | None,
          reason: str, started: float, strict: bool) -> dict[str, Any]:
    tools = {"tools": ctx.state.harness["tools"]} if ctx.state.harness.get("tools") else {}
    state = {**_block(spec, session, started, strict), "route": ctx.state.harness.get("route"), **tools,
             "finish_reason": reason,
             "exit_code": result.exit_code if result else None,
             "output": (result.output[-OUTPUT_TAIL:] if result else "")}
    ctx.state.harness = state
    return state
