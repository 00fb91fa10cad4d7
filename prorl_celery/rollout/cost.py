"""What a trajectory cost, read from its rollout's call records when the job ends, and the
running totals per project that ``/metrics`` and ``prorl-celery status`` report.

Per backend: calls, prompt tokens (the whole prompt of every call: what the server was sent),
generated tokens, prompt tokens its prefix cache held (where it said), and LLM seconds (each call's
latency, retries included); then the wall time of each stage. A call whose server returned no
token ids (chat mode without them) counts as a call with unknown tokens (``calls_without_ids``).
Then ``sandbox``: the CPU-seconds and peak memory of the job's sandboxes, as their hosts read their
cgroups when they closed them (:class:`sandboxes.protocol.SandboxUsage`, kept in the job's state by
:meth:`tasks.context.StageContext.close_sandbox`); None where no cgroup measured them.

Only each record's metadata head leaves Redis (a script cuts it off the packed record there), never
its ids: a bulk cancel of a thousand long rollouts reads kilobytes each, not their token arrays.
"""
from __future__ import annotations

import json
from typing import Any

import redis
from pydantic import BaseModel, Field

from config.settings import get_settings
from prorl_celery import keys
from prorl_celery.models import Timings
from prorl_celery.redisio import LuaScript, missing, text
from prorl_celery.shards import Shards

_STAGES = ("queue", "init", "run", "eval", "total", "llm", "actions", "init_wait")
OPERATOR = "_operator"  # the totals of the operator's jobs (no project name starts with '_')


class BackendCost(BaseModel):
    calls: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    llm_s: float = 0.0
    calls_without_ids: int = 0


class SandboxCost(BaseModel):
    """What the job's sandboxes used (each read by its host at its close, from its cgroup)."""

    cpu_s: float | None = Field(None, description="CPU-seconds of all their processes; None where the "
                                                  "node's cgroups count none (no cpuacct).")
    peak_memory_mb: float = Field(0.0, description="Their memory cgroups' peaks added up (MiB): a bound "
                                                   "of their joint peak.")
    source: str = "cgroup"
    sandboxes: int = Field(1, description="How many sandboxes were measured (sidecars and a grader's too).")


def add_usage(spent: dict[str, Any] | None, usage: Any) -> dict[str, Any]:
    """``spent`` (a job's :class:`SandboxCost` so far, as stored) with one more close's reading
    (a :class:`sandboxes.protocol.SandboxUsage` or its dict) added."""
    new = usage if isinstance(usage, dict) else usage.model_dump()
    if not spent:
        return SandboxCost.model_validate(new).model_dump()
    cpus = [v for v in (spent.get("cpu_s"), new.get("cpu_s")) if v is not None]
    return SandboxCost(cpu_s=round(sum(cpus), 6) if cpus else None, source=new.get("source", "cgroup"),
                       peak_memory_mb=round(spent["peak_memory_mb"] + new["peak_memory_mb"], 3),
                       sandboxes=spent.get("sandboxes", 1) + new.get("sandboxes", 1)).model_dump()


class Cost(BaseModel):
    """One trajectory's cost."""

    llm: dict[str, BackendCost] = Field(default_factory=dict, description="Backend id -> what its calls took.")
    prompt_tokens: int = 0
    generated_tokens: int = 0
    llm_calls: int = 0
    llm_s: float = Field(0.0, description="Seconds of LLM calls (their latency, retries included).")
    wall_s: dict[str, float] = Field(default_factory=dict, description="Seconds per stage (the result's timing).")
    sandbox: SandboxCost | None = Field(None, description="CPU-seconds and peak memory of its sandboxes, from "
                                                          "their cgroups; None: not measured (no cgroup).")
    price: float | None = Field(None, description="The operator's prices applied (PRORL_COST_PRICES); None: none set.")


# KEYS[1]: a rollout's calls list; ARGV[1]: the last index to read. The metadata JSON of each
# packed record (its first 4 bytes are the JSON's length, little-endian), without the arrays.
_HEADS = LuaScript("""
local out = {}
for i, blob in ipairs(redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[1]))) do
  local b1, b2, b3, b4 = string.byte(blob, 1, 4)
  out[i] = string.sub(blob, 5, 4 + b1 + 256 * b2 + 65536 * b3 + 16777216 * b4)
end
return out
""")


def add_call(cost: Cost, meta: dict[str, Any]) -> None:
    keep, (n_new, n_response, _) = int(meta.get("_k", 0)), meta.get("_n", (-1, -1, -1))
    backend = cost.llm.setdefault(str(meta.get("backend_id") or "unknown"), BackendCost())
    backend.calls += 1
    backend.llm_s += float(meta.get("latency_s") or 0.0)
    backend.cached_tokens += int(meta.get("cached_tokens") or 0)
    if n_new < 0 or n_response < 0:
        backend.calls_without_ids += 1
        return
    backend.prompt_tokens += keep + n_new
    backend.generated_tokens += n_response


def cost_of(heads: list[bytes], timing: Timings, sandbox: dict[str, Any] | None = None) -> Cost:
    """The cost of the calls whose metadata heads are ``heads`` (:func:`read_heads`), with the
    job's sandbox usage (its state's, :func:`add_usage`; None: not measured)."""
    cost = Cost(wall_s={name: getattr(timing, name) for name in _STAGES},
                sandbox=SandboxCost.model_validate(sandbox) if sandbox else None)
    for head in heads:
        add_call(cost, json.loads(head))
    for backend in cost.llm.values():
        backend.llm_s = round(backend.llm_s, 6)
        cost.prompt_tokens += backend.prompt_tokens
        cost.generated_tokens += backend.generated_tokens
        cost.llm_calls += backend.calls
        cost.llm_s += backend.llm_s
    cost.llm_s = round(cost.llm_s, 6)
    cost.price = price_of(cost, get_settings().cost_prices)
    return cost


_PRICED = ("prompt_tokens", "generated_tokens", "cached_tokens", "llm_s")


def price_of(cost: Cost, prices: dict[str, float]) -> float | None:
    """One number for the trajectory: each backend's units at its own price (``<id>.<unit>``) or
    the common one (``<unit>``), plus each stage's wall seconds at ``wall_s.<stage>``, plus the
    sandboxes' CPU-seconds at ``sandbox.cpu_s`` (and their peak MiB at ``sandbox.peak_memory_mb``)."""
    if not prices:
        return None
    total = sum(prices.get(f"{bid}.{unit}", prices.get(unit, 0.0)) * getattr(spent, unit)
                for bid, spent in cost.llm.items() for unit in _PRICED)
    total += sum(prices.get(f"wall_s.{stage}", 0.0) * seconds for stage, seconds in cost.wall_s.items())
    if cost.sandbox is not None:
        total += prices.get("sandbox.cpu_s", 0.0) * (cost.sandbox.cpu_s or 0.0)
        total += prices.get("sandbox.peak_memory_mb", 0.0) * cost.sandbox.peak_memory_mb
    return round(total, 9)


def read_heads(client: redis.Redis | Shards, jobs: list[tuple[str, int | None]]) -> list[list[bytes]]:
    """The metadata heads of each job's call records, the first ``n`` (its saved count; None:
    all), in one round trip (per shard; none for jobs that all saved no call)."""
    wanted = [i for i, (_, n) in enumerate(jobs) if n != 0]
    found: dict[int, list[bytes]] = {}
    for store, positions in Shards.of(client).by_store(jobs[i][0] for i in wanted):  # a round trip per shard
        calls = [(keys.rollout_calls(jobs[wanted[k]][0]), -1 if jobs[wanted[k]][1] is None else jobs[wanted[k]][1] - 1)
                 for k in positions]
        pipe = store.pipeline(transaction=False)
        for key, last in calls:
            _HEADS.queue(pipe, [key], [last])
        replies = pipe.execute(raise_on_error=False)
        if any(missing(r) for r in replies):  # a Redis that lost it: whole, once
            pipe = store.pipeline(transaction=False)
            for key, last in calls:
                _HEADS.whole(pipe, [key], [last])
            replies = pipe.execute(raise_on_error=False)
        for r in replies:
            if isinstance(r, Exception):
                raise r
        found.update(zip((wanted[k] for k in positions), replies))
    return [found.get(i, []) for i in range(len(jobs))]


TOTALS = ("jobs", "prompt_tokens", "generated_tokens", "llm_calls", "llm_s", "run_s", "total_s", "price",
          "sandbox_jobs", "sandbox_cpu_s", "sandbox_peak_memory_mb")

# A project's totals keep the largest peak memory of one job.
_KEEP_PEAK = """
local function keep_peak(totals, mb)
  local old = tonumber(redis.call('HGET', totals, 'sandbox_peak_memory_mb') or '-1')
  if tonumber(mb) > old then redis.call('HSET', totals, 'sandbox_peak_memory_mb', mb) end
end
"""
# KEYS[1]: a project's totals; ARGV[1]: a job's peak
_MAX = LuaScript(_KEEP_PEAK + "keep_peak(KEYS[1], ARGV[1])\n")

# One ended job's cost into its project's totals, only if the job's hash (KEYS[1]) still holds the
# end token ARGV[1] its terminal transition wrote, which this removes: the totals count the job
# once, whichever delivery ended it, however often this runs. KEYS[2]: the project's totals,
# KEYS[3]: the set of projects, ARGV[2]: the project's name, ARGV[3]: the job's sandbox peak ('':
# not measured), then (field, amount) pairs, each an HINCRBYFLOAT. Returns 1 if it added them.
ENDED = LuaScript(_KEEP_PEAK + """
if redis.call('HGET', KEYS[1], 'end_token') ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[1], 'end_token')
redis.call('SADD', KEYS[3], ARGV[2])
for i = 4, #ARGV, 2 do redis.call('HINCRBYFLOAT', KEYS[2], ARGV[i], ARGV[i + 1]) end
if ARGV[3] ~= '' then keep_peak(KEYS[2], ARGV[3]) end
return 1
""")
END_TOKEN = "end_token"
"""The job hash's field a terminal transition writes for :func:`queue_ended_totals` (removed
once the totals counted the job)."""


def _increments(cost: Cost) -> dict[str, float]:
    """What one job adds to its project's totals (``jobs``: 1)."""
    out: dict[str, float] = {"jobs": 1, "prompt_tokens": cost.prompt_tokens, "generated_tokens": cost.generated_tokens,
                             "llm_calls": cost.llm_calls, "llm_s": cost.llm_s, "run_s": cost.wall_s.get("run", 0.0),
                             "total_s": cost.wall_s.get("total", 0.0)}
    if cost.price is not None:
        out["price"] = cost.price
    if cost.sandbox is not None:
        out.update(sandbox_jobs=1, sandbox_cpu_s=cost.sandbox.cpu_s or 0.0)
    return out


def add_totals(client: redis.Redis, ended: list[tuple[str | None, Cost]]) -> None:
    """Add ended jobs' costs to their projects' running totals (None: the operator's). Of the
    jobs whose sandboxes were measured: how many (``sandbox_jobs``), their CPU-seconds, and the
    largest peak memory of one job (``sandbox_peak_memory_mb``)."""
    pipe = client.pipeline(transaction=False)
    for project, cost in ended:
        key = keys.cost_totals(project or OPERATOR)
        pipe.sadd(keys.cost_projects(), project or OPERATOR)
        for name, amount in _increments(cost).items():
            if isinstance(amount, int):
                pipe.hincrby(key, name, amount)
            else:
                pipe.hincrbyfloat(key, name, amount)
        if cost.sandbox is not None:
            _MAX.whole(pipe, [key], [cost.sandbox.peak_memory_mb])  # as text: a bulk end's rare path
    pipe.execute()


def ended_totals_args(job_id: str, token: str, project: str | None, cost: Cost) -> tuple[list[str], list[Any]]:
    """The keys and arguments of the script that adds one ended job's ``cost`` to its project's
    totals if the job's hash still holds ``token`` (:data:`END_TOKEN`)."""
    name = project or OPERATOR
    args: list[Any] = [token, name, cost.sandbox.peak_memory_mb if cost.sandbox is not None else ""]
    for field, amount in _increments(cost).items():
        args += [field, amount]
    return [keys.job(job_id), keys.cost_totals(name), keys.cost_projects()], args


def queue_ended_totals(pipe: Any, job_id: str, token: str, project: str | None, cost: Cost) -> None:
    """Queue on ``pipe`` (a pipeline, sent by the caller) the totals of a job whose terminal
    transition, queued ahead of this, wrote ``token`` into its hash as :data:`END_TOKEN`: they
    are added only if it did. By digest: a Redis that lost the script answers NoScriptError,
    and then the caller sends it again whole (:meth:`~prorl_celery.redisio.LuaScript.whole`; once
    more is harmless: the token goes with the first that finds it)."""
    job_keys, args = ended_totals_args(job_id, token, project, cost)
    ENDED.queue(pipe, job_keys, args)


def totals(client: redis.Redis) -> dict[str, dict[str, float]]:
    """Project (``_operator`` for the operator's jobs) -> its running totals."""
    names = sorted(text(m) for m in client.smembers(keys.cost_projects()))
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(keys.cost_totals(name))
    return {name: {text(k): float(v) for k, v in raw.items()}
            for name, raw in zip(names, pipe.execute())}
