"""The head's cost per turn and per rollout, by command: the job store and the rollout store on a
private Redis, driven through their real code paths without sandboxes, Celery workers or an LLM.

Phases, each from ``--procs`` processes at once (forked; each its own Redis connections), each
measured alone by the difference of two readings of Redis's ``INFO`` (``commandstats``: calls and
CPU µs per command; ``stats``: bytes in and out; ``cpu``: the server's own CPU) and of the
processes' own CPU:

- ``submit``: ``POST /jobs`` in batches of 250 through ``create_app()``'s test client (the API's
  checks, ``JobStore.create_many``, the chains sent to the broker on the same Redis);
- ``init``: an empty stage through ``tasks.stages.run_stage`` (the record read, the stage lease,
  the transitions to running and to done, the stage histogram): one stage transition pair;
- ``run``: the realistic profile's turns through ``run_stage``: per turn, ``ctx.check()``, the LLM
  pool's routing (``Router.acquire`` and ``release`` of a registered backend nobody calls), the
  watch (``ctx.stopped()``), the turn and its tool message into the transcript, ``ctx.save()``
  (the save script);
- ``eval``: ``run_stage`` to the end: the result, its cost (the rollout's call heads), the
  terminal transition and the completion streams;
- ``completions``: ``GET /completions`` paged through every finished job;
- ``read``: ``GET /jobs/<id>`` of every job (the trajectory with its messages, ids and logprobs).

Then, alone, the per-turn parts named: the save script, ``check``, the routing scripts, and one
reading of the watch over ``--watch-jobs`` jobs (a reading costs per watched job; amortised per
turn it is ``readings/s x turn_s`` job-reads: the ceiling table states it at 16 s turns).

    python3 bench/head.py [--procs 4] [--rollouts 400] [--turns 40] [--context 16k]
    python3 bench/head.py --quick        # seconds: a smoke run
    python3 bench/head.py --shards 2     # the rollouts' lists on 2 store Redis (prorl_celery/shards.py)
    python3 bench/head.py --routing-redis   # the LLM routing on a Redis of its own (prorl_celery/llm/store.py)
    python3 bench/head.py --routing-redis --backends 400   # the routing among 400 registered backends

With ``--shards N`` the launcher starts N store Redis beside the head's; every reading is taken
of each instance, and the report adds each one's CPU per unit and the ceiling of the sharded head:
``min(head core, N shard cores)`` in turns/s (bench/RESULTS.md, "The ceiling"). With
``--routing-redis`` the routing's Redis (``appendfsync everysec``) is read alike: the report adds
the head's and the routing's CPU per unit, user and system apart, and their commands.

Redis's CPU per command is the server's own (robust to a shared machine); throughput and the
processes' CPU are not. Last line: ``head turns_per_s= rollouts_per_s= redis_us_per_turn=
ceiling_turns_per_s_per_core=``.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import secrets
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.private import REDIS_PASSWORD, REDIS_PORT  # noqa: E402  (sets the environment)

os.environ.setdefault("PRORL_API_TOKEN", secrets.token_urlsafe(16))
os.environ["PRORL_PLUGIN_PACKAGES"] = ",".join(filter(None, [os.environ.get("PRORL_PLUGIN_PACKAGES"), "bench"]))

from tasks.handlers.base import AgentHandler  # noqa: E402

DATA_SOURCE = "bench.head:BenchHandler"
BATCH = 250
SHAPE_ENV = "BENCH_HEAD_SHAPE"  # the profile, for the handler (loaded by its dotted path) in every process


def profile(turns: int, context: int) -> dict:
    """bench/scale.py's realistic shapes: a ~2.5 kB system prompt and task, then per turn an
    assistant call of ~100 tokens and an observation sized so the prompt nears ``context`` tokens
    by the last turn (a token per byte, as the fake's tokenizer counts)."""
    observation = max(64, (context - 2500) // max(1, turns - 1) - 155)
    return {"turns": turns, "observation": observation, "system": 2400, "response": 100}


class BenchHandler(AgentHandler):
    """The stages with no sandbox and no LLM: what the head sees of a realistic rollout."""

    name = "bench-head"

    def check_instance(self, instance: dict) -> None:
        pass

    def init(self, ctx) -> None:
        pass

    def run(self, ctx) -> None:
        drive_turns(ctx, json.loads(os.environ[SHAPE_ENV]))

    def eval(self, ctx) -> dict:
        return {"reward": 1.0, "resolved": True}

    def on_exception(self, ctx, exc) -> None:
        pass

    def finish(self, ctx) -> None:
        pass


def make_turn(k: int, prompt: list[int], shape: dict):
    from prorl_celery.llm.models import Protocol, Turn

    response = [(k * 7 + i) % 50000 for i in range(shape["response"])]
    call = {"id": f"call_{k}", "name": "bash", "arguments": json.dumps({"command": f"ls -la /usr/bin | tail -n +{k + 1}"})}
    return Turn(backend_id="bench", address="http://bench.invalid", weight_version="v0", protocol=Protocol.CHAT,
                model="bench", content=f"Step {k}: look at the tools available.", tool_calls=[call],
                finish_reason="tool_calls", prompt_ids=list(prompt), response_ids=response,
                logprobs=[-0.25 - i * 1e-4 for i in range(len(response))], token_source="server",
                message_count=2 + 2 * k, started_at=time.time(), latency_s=0.5)


def drive_turns(ctx, shape: dict, route: bool = True) -> int:
    """The built-in agent's per-turn traffic with the head (tasks/agent/loop.py), turns instant."""
    from prorl_celery.llm.models import Protocol
    from prorl_celery.llm.routing import Router

    router = Router(ctx.store.redis)
    transcript = ctx.transcript
    if not transcript.messages:
        transcript.messages += [{"role": "system", "content": "s" * shape["system"]},
                                {"role": "user", "content": "What is 3/4 + 1/4 + 1/2?"}]
    prompt = [i % 50000 for i in range(shape["system"])]
    for k in range(shape["turns"]):
        ctx.check()
        if route:
            slot = router.acquire(ctx.job_id, Protocol.CHAT)
            router.release(slot, "ok")
        ctx.stopped()
        turn = make_turn(k, prompt, shape)
        transcript.answer(turn)
        transcript.messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": "o" * shape["observation"]})
        ctx.state.setdefault("agent", {}).update(turn_count=k + 1, generated=(k + 1) * shape["response"])
        ctx.save()
        prompt = prompt + turn.response_ids + [7] * (shape["observation"] + 55)
    return shape["turns"]


# -- the processes ------------------------------------------------------------------------------
def _task():
    return SimpleNamespace(request=SimpleNamespace(hostname="bench-head", chain=None))


def _client():
    from flask_api import create_app

    return create_app({"TESTING": True}).test_client(), {"Authorization": f"Bearer {os.environ['PRORL_API_TOKEN']}"}


def work_submit(n: int) -> tuple[float, list[str]]:
    client, auth = _client()
    started, ids = time.process_time(), []
    for first in range(0, n, BATCH):
        body = {"jobs": [{"instance": {"data_source": DATA_SOURCE}} for _ in range(min(BATCH, n - first))]}
        reply = client.post("/jobs", json=body, headers=auth)
        assert reply.status_code == 202, reply.get_data(as_text=True)
        ids += reply.get_json()["job_ids"]
    return time.process_time() - started, ids


def work_stage(args: tuple[str, list[str]]) -> tuple[float, int]:
    from prorl_celery.status import JobStatus
    from tasks.stages import run_stage

    stage, ids = JobStatus(args[0]), args[1]
    started = time.process_time()
    from celery.exceptions import Ignore
    from prorl_celery.connections import get_store

    for job_id in ids:
        try:
            out = run_stage(_task(), stage, job_id)
        except Ignore:
            record = get_store().get(job_id)
            raise AssertionError(f"{stage} of {job_id} not run: {record.status}/{record.stage_state} {record.result}")
        assert out and "skipped" not in out and out.get("status") != "failed", out
    return time.process_time() - started, len(ids)


def work_completions(_: int) -> tuple[float, int]:
    client, auth = _client()
    started, cursor, seen = time.process_time(), "0", 0
    while True:
        reply = client.get(f"/completions?cursor={cursor}&limit=500", headers=auth).get_json()
        if not reply["completions"]:
            return time.process_time() - started, seen
        seen, cursor = seen + len(reply["completions"]), reply["cursor"]


def work_read(ids: list[str]) -> tuple[float, int]:
    client, auth = _client()
    started = time.process_time()
    for job_id in ids:
        view = client.get(f"/jobs/{job_id}", headers=auth).get_json()
        assert view["status"] == "completed", view
    return time.process_time() - started, len(ids)


# -- Redis's readings ---------------------------------------------------------------------------
class Reading:
    def __init__(self, redis):
        self.commands = {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
                         for k, v in redis.info("commandstats").items()}
        info = redis.info()
        self.cpu_us = (float(info["used_cpu_sys"]) + float(info["used_cpu_user"])) * 1e6
        self.sys_us = float(info["used_cpu_sys"]) * 1e6  # system calls: the AOF's fsync, the sockets
        self.bytes_in, self.bytes_out = int(info["total_net_input_bytes"]), int(info["total_net_output_bytes"])
        self.memory = int(info["used_memory"])
        self.wall = time.perf_counter()


INSTANCES: dict[str, object] = {}  # name -> client of every Redis measured: "head", "shard-1" ..., "routing"


def readings() -> dict[str, Reading]:
    return {name: Reading(client) for name, client in INSTANCES.items()}


IDLE_US_PER_S: dict[str, float] = {}  # each store shard's own CPU with nothing asked (serverCron, AOF)
IDLE_SYS_US_PER_S: dict[str, float] = {}  # of which system time


def idle_rates(seconds: float = 2.0) -> None:
    """Each store shard's CPU at rest, taken off its phases (a shard a phase does not touch
    would otherwise be charged its timers; the head's figures stay as item 1 measured them)."""
    before = readings()
    time.sleep(seconds)
    after = readings()
    IDLE_US_PER_S.update({k: max(0.0, (after[k].cpu_us - before[k].cpu_us) / (after[k].wall - before[k].wall))
                          for k in before if k != "head"})
    IDLE_SYS_US_PER_S.update({k: max(0.0, (after[k].sys_us - before[k].sys_us) / (after[k].wall - before[k].wall))
                              for k in before if k != "head"})


def phases_of(name: str, unit: str, before: dict, after: dict, units: int, client_cpu_s: float) -> Phase:
    """The head's phase, with each store shard's beside it (``.shards``, its idle CPU taken off)."""
    head = Phase(name, unit, before["head"], after["head"], units, client_cpu_s)
    head.shards, head.routing = [], None
    for k in (k for k in before if k != "head"):
        other = Phase(name, unit, before[k], after[k], units, 0.0)
        other.redis_cpu_us = max(0.0, other.redis_cpu_us - IDLE_US_PER_S.get(k, 0.0) * other.wall)
        other.redis_sys_us = min(other.redis_cpu_us,
                                 max(0.0, other.redis_sys_us - IDLE_SYS_US_PER_S.get(k, 0.0) * other.wall))
        if k == "routing":
            head.routing = other
        else:
            head.shards.append(other)
    return head


class Phase:
    """What Redis and the driving processes spent on ``units`` of something."""

    def __init__(self, name: str, unit: str, before: Reading, after: Reading, units: int, client_cpu_s: float):
        self.name, self.unit, self.units = name, unit, max(1, units)
        self.wall = after.wall - before.wall
        self.commands = {k: (c - before.commands.get(k, (0, 0))[0], u - before.commands.get(k, (0, 0))[1])
                         for k, (c, u) in after.commands.items()}
        self.commands = {k: v for k, v in self.commands.items() if v[0] > 0 and k not in ("info",)}
        self.redis_cpu_us = after.cpu_us - before.cpu_us
        self.redis_sys_us = after.sys_us - before.sys_us
        self.bytes_in, self.bytes_out = after.bytes_in - before.bytes_in, after.bytes_out - before.bytes_out
        self.memory = after.memory - before.memory
        self.client_cpu_us = client_cpu_s * 1e6

    def per(self, value: float) -> float:
        return value / self.units

    def row(self) -> str:
        cmd_us = sum(u for _, u in self.commands.values())
        return (f"| {self.name} | per {self.unit} | {self.per(sum(c for c, _ in self.commands.values())):.1f} "
                f"| {self.per(cmd_us):.0f} | {self.per(self.redis_cpu_us):.0f} | {self.per(self.redis_sys_us):.0f} "
                f"| {self.per(self.bytes_in) / 1e3:.2f} "
                f"| {self.per(self.bytes_out) / 1e3:.2f} | {self.per(self.memory) / 1e3:.2f} "
                f"| {self.per(self.client_cpu_us):.0f} | {self.units / self.wall:.0f} |")

    def detail(self) -> str:
        top = sorted(self.commands.items(), key=lambda kv: -kv[1][1])
        return f"{self.name} (per {self.unit}): " + ", ".join(
            f"{k} {self.per(c):.2f}x {self.per(u):.1f}us ({u / max(c, 1):.1f}/call)" for k, (c, u) in top)


HEADER = ("| phase | unit | Redis calls (scripts' own inside) | Redis command µs (scripts include their calls) "
          "| Redis CPU µs (server, all) | of which system µs | kB in | kB out | memory kB held | driver CPU µs | units/s |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def measure(redis, name: str, unit: str, pool, func, parts: list, units: int) -> tuple[Phase, list]:
    before = readings()
    out = pool.map(func, parts)
    after = readings()
    return phases_of(name, unit, before, after, units, sum(o[0] for o in out)), out


def split(items: list, n: int) -> list[list]:
    return [items[i::n] for i in range(n)]


def alone(redis, name: str, unit: str, n: int, func) -> Phase:
    """``func`` run ``n`` times in this process, measured alone."""
    before, started = readings(), time.process_time()
    for _ in range(n):
        func()
    return phases_of(name, unit, before, readings(), n, time.process_time() - started)


def parts_alone(redis, shape: dict, watch_jobs: int, n: int) -> list[Phase]:
    """The per-turn parts, each alone in this process (so each script's EVALSHA is its own)."""
    from prorl_celery.connections import get_store
    from prorl_celery.llm.models import Protocol
    from prorl_celery.llm.routing import Router
    from prorl_celery.models import JobRequest
    from prorl_celery.status import JobStatus, StageState
    from prorl_celery.watch import StatusWatch
    from tasks.context import StageContext

    store = get_store()
    ids = [uuid.uuid4().hex for _ in range(max(watch_jobs, 4))]
    store.create_many([(i, JobRequest(instance={"data_source": DATA_SOURCE})) for i in ids])
    for i in ids[:4]:
        store.transition(i, JobStatus.INIT, stage_state=StageState.RUNNING)
        store.transition(i, JobStatus.RUN, stage_state=StageState.RUNNING)
    ctx = StageContext(store, store.get(ids[0]), JobStatus.RUN, 3600)
    transcript, prompt, k = ctx.transcript, list(range(shape["system"])), [0]

    def one_save():
        turn = make_turn(k[0] % shape["turns"], prompt, shape)
        transcript.answer(turn)
        transcript.messages.append({"role": "tool", "tool_call_id": "c", "content": "o" * shape["observation"]})
        ctx.save()
        k[0] += 1

    router = Router(store.redis)

    def route():
        router.release(router.acquire(ids[1], Protocol.CHAT), "ok")

    watch = StatusWatch(store, max_age_s=0.0, forget_s=1e9)  # every ask a reading; nobody forgotten
    for job_id in ids[:watch_jobs]:
        watch.status(job_id)  # each asked once: read alone, then in the set
    watch.status(ids[0])  # the first reading adds them all

    out = [alone(redis, "turn: save script (ctx.save)", "turn", n, one_save),
           alone(redis, "turn: ctx.check (HGET status)", "turn", n, ctx.check),
           alone(redis, "turn: LLM routing (acquire + release)", "turn", n, route),
           alone(redis, f"watch reading of {watch_jobs} jobs", "reading", max(3, n // 20),
                 lambda: watch.status(ids[0]))]
    return out


def start_redis(state: Path, persist: bool = True):
    from prorl_celery.ops.launcher import Stack, StackOptions

    stack = Stack(StackOptions(state_dir=state, redis_password=REDIS_PASSWORD, persist=persist))
    stack.start_redis(REDIS_PORT)
    return stack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=4, help="driving processes per phase")
    parser.add_argument("--rollouts", type=int, default=400)
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--context", default="16k")
    parser.add_argument("--watch-jobs", type=int, default=1000, help="jobs one watch reads per reading")
    parser.add_argument("--turn-s", type=float, default=16.0, help="turn time for the ceiling's watch term")
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    parser.add_argument("--no-aof", action="store_true",
                        help="Redis without its AOF (the service fsyncs every write: this shows what that costs)")
    parser.add_argument("--shards", type=int, default=0, help="store Redis for the rollouts' lists (0: the head's)")
    parser.add_argument("--routing-redis", action="store_true",
                        help="the LLM routing on a Redis of its own, appendfsync everysec (default: the head's)")
    parser.add_argument("--backends", type=int, default=1,
                        help="LLM backends registered (the routing's cost per turn grew with them before issue 37)")
    args = parser.parse_args()
    if args.quick:
        args.procs, args.rollouts, args.turns, args.watch_jobs = 2, 8, 4, 20
    context = int(args.context.lower().removesuffix("k")) * (1000 if args.context.lower().endswith("k") else 1)
    shape = profile(args.turns, context)
    os.environ[SHAPE_ENV] = json.dumps(shape)
    print(f"load average at the start: {os.getloadavg()}; procs {args.procs}; rollouts {args.rollouts}; "
          f"backends {args.backends}; shape {shape}", flush=True)
    stack = start_redis(Path(tempfile.mkdtemp(prefix="bench-head-")), persist=not args.no_aof)
    try:  # only its Redis: not ``with stack``, which starts the whole stack
        from config.settings import get_settings
        from prorl_celery.connections import get_redis, get_shards
        from prorl_celery.llm.models import BackendSpec
        from prorl_celery.llm.registry import BackendRegistry

        if args.shards:  # before any process reads its settings: the forked drivers inherit them
            os.environ["PRORL_STORE_SHARDS"] = ",".join(stack.start_store_shards(args.shards))
            get_settings.cache_clear()
        if args.routing_redis:
            os.environ["PRORL_ROUTING_URL"] = stack.start_routing_redis()
            get_settings.cache_clear()
        redis = get_redis()
        INSTANCES.update(head=redis, **{f"shard-{i + 1}": c for i, c in enumerate(get_shards().stores)})
        if args.routing_redis:
            from prorl_celery.llm.store import routing_redis

            INSTANCES["routing"] = routing_redis(redis)
        if args.shards or args.routing_redis:
            idle_rates()
        server = redis.info("server")
        print(f"redis {server['redis_version']}, aof_enabled {redis.info('persistence').get('aof_enabled')} "
              "(the launcher's: AOF, fsync always on the head, everysec on store shards; --no-aof: none)", flush=True)
        for i in range(args.backends):  # never full: every turn's choice is its rollout's backend, or a new one's
            BackendRegistry(redis).add(BackendSpec(address=f"http://bench-{i}.invalid:1", capacity=100000, probe=False))
        phases = run_phases(redis, args)
        detail = parts_alone(redis, shape, args.watch_jobs, 20 if args.quick else 400)
        report(phases, detail, args)
    finally:
        stack.stop()


def run_phases(redis, args) -> list[Phase]:
    ctx = multiprocessing.get_context("fork")
    phases = []
    with ctx.Pool(args.procs) as pool:
        shares = [len(s) for s in split(list(range(args.rollouts)), args.procs)]
        phase, out = measure(redis, "submit (POST /jobs, batches of 250)", "job", pool, work_submit, shares,
                             args.rollouts)
        phases.append(phase)
        ids = [i for _, got in out for i in got]
        for stage, unit in (("init", "stage"), ("run", "turn"), ("eval", "rollout")):
            units = len(ids) * (args.turns if stage == "run" else 1)
            name = {"init": "stage start + end (init, empty)", "run": "run stage: turns (the stage's own start/end "
                    "amortised)", "eval": "eval to completed (result, cost, completion streams)"}[stage]
            phase, _ = measure(redis, name, unit, pool, work_stage, [(stage, s) for s in split(ids, args.procs)],
                               units)
            phases.append(phase)
        phase, _ = measure(redis, "completions (GET /completions, pages of 500)", "completion", pool,
                           work_completions, [0], len(ids))
        phases.append(phase)
        phase, _ = measure(redis, "result read (GET /jobs/<id>)", "read", pool, work_read, split(ids, args.procs),
                           len(ids))
        phases.append(phase)
    return phases


def report(phases: list[Phase], detail: list[Phase], args) -> None:
    print(HEADER)
    for phase in [*phases, *detail]:
        print(phase.row())
    print()
    for phase in [*phases, *detail]:
        print(phase.detail())
    run, reading = phases[2], detail[-1]
    per_turn = run.per(run.redis_cpu_us)
    per_job_read = reading.per(reading.redis_cpu_us) / args.watch_jobs
    watch_per_turn = per_job_read * args.turn_s / 0.2  # readings every MAX_AGE_S of each job, over a turn
    stages = sum(p.per(p.redis_cpu_us) for p in phases[:4] if p is not run)  # run's own: in its turns
    per_rollout_us = per_turn * args.turns + watch_per_turn * args.turns + stages + sum(
        p.per(p.redis_cpu_us) for p in phases[4:])
    ceiling = 1e6 / (per_turn + watch_per_turn)
    print(f"\nRedis CPU per turn {per_turn:.0f} us (run phase) + the watch {watch_per_turn:.0f} us "
          f"({per_job_read:.2f} us per job per reading, read every 0.2 s over a {args.turn_s:g} s turn); "
          f"per rollout {per_rollout_us / 1e3:.1f} ms (turns, watch, submit, 3 stages, completion, one read; server CPU)")
    print(f"ceiling per Redis core: {ceiling:.0f} turns/s = {ceiling * args.turn_s:.0f} rollouts in flight at "
          f"{args.turn_s:g} s turns; {1e6 / per_rollout_us:.0f} rollouts/s")
    wall_turns = run.units / run.wall
    print(f"head turns_per_s={wall_turns:.0f} rollouts_per_s={phases[3].units / phases[3].wall:.0f} "
          f"redis_us_per_turn={per_turn + watch_per_turn:.0f} ceiling_turns_per_s_per_core={ceiling:.0f}")
    if run.shards:
        shard_report(phases, detail, run, watch_per_turn, args)
    if run.routing:
        routing_report(phases, detail, run, watch_per_turn, args)
    print(json.dumps({"load_average_end": os.getloadavg()}))


def shard_report(phases: list[Phase], detail: list[Phase], run: Phase, watch_per_turn: float, args) -> None:
    """Each instance's CPU per unit, and the sharded head's ceiling: the head's Redis holds a
    turn's routing, check, watch and state write; the shards share its append."""
    names = ["head", *(f"shard-{i + 1}" for i in range(len(run.shards)))]
    print("\n| phase | unit | " + " | ".join(f"{n} CPU µs" for n in names) + " | all |")
    print("|---|---|" + "---|" * (len(names) + 1))
    for phase in [*phases, *detail]:
        cpus = [phase.per(p.redis_cpu_us) for p in (phase, *phase.shards)]
        print(f"| {phase.name} | per {phase.unit} | " + " | ".join(f"{c:.0f}" for c in cpus) + f" | {sum(cpus):.0f} |")
    head_turn = run.per(run.redis_cpu_us) + watch_per_turn
    shard_turn = sum(run.per(p.redis_cpu_us) for p in run.shards)  # all shards together, per turn
    n = len(run.shards)
    head_cap, shard_cap = 1e6 / head_turn, n * 1e6 / max(shard_turn, 1e-9)
    ceiling = min(head_cap, shard_cap)
    print(f"\nsharded: head {head_turn:.0f} us per turn (with the watch), the shards {shard_turn:.0f} us per turn "
          f"in all ({shard_turn / n:.0f} each); head core full at {head_cap:.0f} turns/s, {n} shard cores at "
          f"{shard_cap:.0f}; ceiling {ceiling:.0f} turns/s = {ceiling * args.turn_s:.0f} rollouts in flight at "
          f"{args.turn_s:g} s turns")
    print(f"head_sharded shards={n} head_us_per_turn={head_turn:.0f} shard_us_per_turn={shard_turn:.0f} "
          f"ceiling_turns_per_s={ceiling:.0f}")


def routing_report(phases: list[Phase], detail: list[Phase], run: Phase, watch_per_turn: float, args) -> None:
    """The head's and the routing's Redis side by side (CPU user and system, commands), and the
    head's ceiling with the routing's writes elsewhere."""
    print("\n| phase | unit | head calls | head CPU µs (user / sys) | routing calls | routing CPU µs (user / sys) |")
    print("|---|---|---|---|---|---|")
    for phase in [*phases, *detail]:
        cells = []
        for p in (phase, phase.routing):
            calls = p.per(sum(c for c, _ in p.commands.values()))
            cpu, sys_ = p.per(p.redis_cpu_us), p.per(p.redis_sys_us)
            cells.append(f"{calls:.1f} | {cpu:.0f} ({cpu - sys_:.0f} / {sys_:.0f})")
        print(f"| {phase.name} | per {phase.unit} | " + " | ".join(cells) + " |")
    head_turn = run.per(run.redis_cpu_us) + watch_per_turn
    routing_turn = run.per(run.routing.redis_cpu_us)
    head_cap, routing_cap = 1e6 / head_turn, 1e6 / max(routing_turn, 1e-9)
    print(f"\nrouting apart: head {head_turn:.0f} us per turn (with the watch), the routing's Redis "
          f"{routing_turn:.0f}; head core full at {head_cap:.0f} turns/s, the routing's at {routing_cap:.0f}; "
          f"ceiling {min(head_cap, routing_cap):.0f} turns/s = {min(head_cap, routing_cap) * args.turn_s:.0f} "
          f"rollouts in flight at {args.turn_s:g} s turns")
    print(f"head_routed head_us_per_turn={head_turn:.0f} routing_us_per_turn={routing_turn:.0f} "
          f"ceiling_turns_per_s={min(head_cap, routing_cap):.0f}")


if __name__ == "__main__":
    main()
