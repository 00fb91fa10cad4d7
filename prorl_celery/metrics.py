"""Prometheus metrics, read from Redis at scrape time, so every API replica reports the same.

Stage durations are recorded by the stage tasks into per-stage histogram hashes; everything else
(jobs by status, queue depths, sandbox hosts, LLM backends, sweep actions) is read as it is.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from config.celeryconfig import QUEUES
from prorl_celery import keys
from prorl_celery.jobs import JobStore
from prorl_celery.llm.store import llm_in_flight
from prorl_celery.redisio import text
from prorl_celery.status import JobStatus

BUCKETS = (0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)


def observe_stage(client: redis.Redis, stage: str, seconds: float) -> None:
    """Count one finished stage of ``seconds`` into the stage's histogram."""
    pipe = client.pipeline(transaction=False)
    queue_stage_observation(pipe, stage, seconds)
    pipe.execute()


def queue_stage_observation(pipe, stage: str, seconds: float) -> None:
    """:func:`observe_stage`'s commands queued on ``pipe`` (sent with the caller's own)."""
    key = keys.stage_histogram(stage)
    bound = next((b for b in BUCKETS if seconds <= b), None)
    if bound is not None:  # one bucket per observation; the collector makes them cumulative
        pipe.hincrby(key, f"b:{bound}", 1)
    pipe.hincrby(key, "count", 1)
    pipe.hincrbyfloat(key, "sum", seconds)


def count_sweep(client: redis.Redis, counts: dict[str, int]) -> None:
    pipe = client.pipeline(transaction=False)
    for action, n in counts.items():
        if n:
            pipe.hincrby(keys.sweep_counts(), action, n)
    pipe.execute()


class ServiceCollector(Collector):
    def __init__(self, store: JobStore):
        self.store = store

    def collect(self) -> Iterator:
        yield from self._jobs()
        yield from self._stages()
        yield from self._queues()
        yield from self._hosts()
        yield from self._backends()
        yield from self._sweep()
        yield from self._projects()

    def _jobs(self):
        active = GaugeMetricFamily("prorl_jobs", "Jobs now in an active status", labels=["status", "data_source"])
        ended = CounterMetricFamily("prorl_jobs_finished", "Jobs that ended, by status",
                                    labels=["status", "data_source"])
        for (status, source), n in sorted(self.store.counts_by_source().items()):
            (ended if JobStatus(status).terminal else active).add_metric([status, source], max(n, 0))
        yield active
        yield ended

    def _stages(self):
        family = HistogramMetricFamily("prorl_stage_seconds", "Duration of finished stages", labels=["stage"])
        for stage in ("init", "run", "eval"):
            raw = {text(k): float(v) for k, v in self.store.redis.hgetall(keys.stage_histogram(stage)).items()}
            running, buckets = 0.0, []
            for bound in BUCKETS:
                running += raw.get(f"b:{bound}", 0.0)
                buckets.append((str(bound), running))
            buckets.append(("+Inf", raw.get("count", 0.0)))
            family.add_metric([stage], buckets, raw.get("sum", 0.0))
        yield family

    def _queues(self):
        family = GaugeMetricFamily("prorl_queue_depth", "Messages waiting in a Celery queue", labels=["queue"])
        pipe = self.store.redis.pipeline(transaction=False)
        for queue in QUEUES:
            pipe.llen(queue)
        for queue, depth in zip(QUEUES, pipe.execute()):
            family.add_metric([queue], depth)
        yield family

    def _hosts(self):
        live = GaugeMetricFamily("prorl_sandboxes", "Live sandboxes per sandbox host", labels=["host"])
        capacity = GaugeMetricFamily("prorl_sandbox_capacity", "Sandbox capacity per host", labels=["host"])
        seen = GaugeMetricFamily("prorl_sandbox_host_heartbeat_age_seconds", "Seconds since a host's heartbeat",
                                 labels=["host"])
        now = time.time()
        for host_id, beat in self.store.redis.zrange(keys.hosts(), 0, -1, withscores=True):
            host_id = text(host_id)
            record = {text(k): text(v) for k, v in self.store.redis.hgetall(keys.host(host_id)).items()}
            live.add_metric([host_id], float(record.get("live", 0)))
            capacity.add_metric([host_id], float(record.get("capacity", 0)))
            seen.add_metric([host_id], now - beat)
        yield live
        yield capacity
        yield seen

    def _backends(self):
        try:
            from prorl_celery.llm.metrics import backend_metrics
        except ImportError:
            return
        yield from backend_metrics(self.store.redis)

    def _sweep(self):
        family = CounterMetricFamily("prorl_sweep_actions", "What the beat sweep did", labels=["action"])
        for action, n in self.store.redis.hgetall(keys.sweep_counts()).items():
            family.add_metric([text(action)], int(n))
        yield family

    def _fair_share(self, names: list[str]):
        """Per project: its jobs pending in fair share, the quota holding it (if one does), its
        LLM requests in flight and the sandboxes its jobs in a stage hold
        (:mod:`prorl_celery.fairshare`, :mod:`prorl_celery.quotas`)."""
        pending = GaugeMetricFamily("prorl_project_pending", "A project's jobs waiting for fair share to "
                                    "release them to the stages", labels=["project"])
        held = GaugeMetricFamily("prorl_project_quota_held", "1 while one of the project's quotas holds its "
                                 "next job", labels=["project", "quota"])
        llm = GaugeMetricFamily("prorl_project_llm_in_flight", "The project's LLM requests in flight",
                                labels=["project"])
        boxes = GaugeMetricFamily("prorl_project_sandboxes", "Sandboxes the project's jobs in init, run or eval "
                                  "may hold at once (their sandbox needs summed: what max_sandboxes counts)",
                                  labels=["project"])
        pipe = self.store.redis.pipeline(transaction=False)
        for name in names:
            pipe.zcard(keys.fair_pending(name))
        for name in names:
            pipe.get(keys.project_sandboxes(name))
        pipe.hgetall(keys.fair_held())
        replies = pipe.execute()
        in_flight = llm_in_flight(self.store.redis, names)
        holding = {text(k): text(v).split("|", 1)[1] for k, v in replies[-1].items()}
        for i, name in enumerate(names):
            pending.add_metric([name], replies[i])
            boxes.add_metric([name], max(0, int(replies[len(names) + i] or 0)))
            llm.add_metric([name], in_flight[i])
            if name in holding:
                held.add_metric([name, holding[name]], 1)
        yield from (pending, held, llm, boxes)

    def _projects(self):
        """Per project (``_operator``: the operator's jobs): its jobs by status, and what its ended
        jobs cost (:mod:`prorl_celery.rollout.cost`)."""
        from prorl_celery.rollout.cost import totals

        jobs = GaugeMetricFamily("prorl_project_jobs", "A project's jobs by status (active now, ended in total)",
                                 labels=["project", "status"])
        names = sorted(text(n) for n in self.store.redis.hkeys(keys.projects()))
        for name in names:
            for status, n in self.store.counts(name).items():
                jobs.add_metric([name, status], max(n, 0))
        yield jobs
        yield from self._fair_share(names)
        spent = totals(self.store.redis)
        for metric, field, help_ in (
                ("prorl_project_finished", "jobs", "Jobs of the project that ended (their cost is counted)"),
                ("prorl_project_prompt_tokens", "prompt_tokens", "Prompt tokens its ended jobs sent"),
                ("prorl_project_generated_tokens", "generated_tokens", "Tokens its ended jobs generated"),
                ("prorl_project_llm_calls", "llm_calls", "LLM calls of its ended jobs"),
                ("prorl_project_llm_seconds", "llm_s", "Seconds of LLM calls of its ended jobs"),
                ("prorl_project_run_seconds", "run_s", "Seconds its ended jobs spent in the run stage"),
                ("prorl_project_rollout_seconds", "total_s", "Wall seconds of its ended jobs, submission to end"),
                ("prorl_project_price", "price", "Its ended jobs at the operator's prices (PRORL_COST_PRICES)"),
                ("prorl_project_sandbox_measured", "sandbox_jobs", "Its ended jobs whose sandboxes' cgroups were read"),
                ("prorl_project_sandbox_cpu_seconds", "sandbox_cpu_s",
                 "CPU-seconds of its ended jobs' sandboxes (their cgroups)")):
            family = CounterMetricFamily(metric, help_, labels=["project"])
            for name, values in spent.items():
                family.add_metric([name], values.get(field, 0.0))
            yield family
        peak = GaugeMetricFamily("prorl_project_sandbox_peak_memory_mb",
                                 "The largest peak memory (MiB, its sandboxes' cgroups) of one of its ended jobs",
                                 labels=["project"])
        for name, values in spent.items():
            if "sandbox_peak_memory_mb" in values:
                peak.add_metric([name], values["sandbox_peak_memory_mb"])
        yield peak
