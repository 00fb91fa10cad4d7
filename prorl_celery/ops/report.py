"""What is running: workers per queue, queue depths, sandbox hosts, LLM backends, jobs by status.

Shared by ``GET /healthz`` and ``prorl-celery status``.
"""
from __future__ import annotations

import time
from typing import Any

from config.celeryconfig import QUEUES
from prorl_celery import keys
from prorl_celery.jobs import JobStore
from prorl_celery.llm.store import routing_redis
from prorl_celery.redisio import text
from prorl_celery.workers import workers_per_queue


def snapshot(store: JobStore) -> dict[str, Any]:
    client = store.redis
    workers = workers_per_queue()
    depths = {queue: client.llen(queue) for queue in QUEUES}
    hosts = []
    now = time.time()
    for host_id, beat in client.zrange(keys.hosts(), 0, -1, withscores=True):
        record = {text(k): text(v) for k, v in client.hgetall(keys.host(text(host_id))).items()}
        hosts.append({"host_id": text(host_id), "address": record.get("address", "?"),
                      "live": int(record.get("live", 0)), "capacity": int(record.get("capacity", 0)),
                      "heartbeat_age_s": round(now - beat, 1)})
    backends = []
    routing = routing_redis(client)  # the backends and their leases (prorl_celery/llm/store.py)
    for backend_id in sorted(text(x) for x in routing.smembers(keys.llm_backends())):
        record = {text(k): text(v) for k, v in routing.hgetall(keys.llm_backend(backend_id)).items()}
        backends.append({"id": backend_id, "address": record.get("address", "?"),
                         "status": record.get("status", "?"), "capacity": record.get("capacity", "?"),
                         "in_flight": routing.zcount(keys.llm_inflight(backend_id), now * 1000, "+inf"),
                         "weight_version": record.get("weight_version", "")})
    from prorl_celery.rollout.cost import totals

    names = sorted(text(n) for n in client.hkeys(keys.projects()))
    return {"queues": {q: {"depth": depths[q], "workers": workers.get(q, [])} for q in QUEUES},
            "hosts": hosts, "backends": backends, "jobs": store.counts(), "projects": totals(client),
            "held": dict(zip(names, holdings(store, names)))}


def holdings(store: JobStore, names: list[str]) -> list[dict[str, int]]:
    """What each project holds now: its rollouts in a stage, the sandboxes they may hold (their
    needs summed: what ``max_sandboxes`` counts), its jobs pending in fair share."""
    from prorl_celery.fairshare import FairShare

    fair = FairShare(store.redis)
    return [{"in_stages": sum(n for s, n in store.counts(name).items() if s in ("init", "run", "eval")),
             "sandboxes": boxes, "pending": fair.pending(name)}
            for name, boxes in zip(names, fair.sandboxes(names))]


def render(snap: dict[str, Any]) -> str:
    sections = [
        _table(["queue", "depth", "workers"],
               [[q, str(v["depth"]), ", ".join(v["workers"]) or "-"] for q, v in snap["queues"].items()]),
        _table(["sandbox host", "address", "live", "capacity", "heartbeat"],
               [[h["host_id"], h["address"], str(h["live"]), str(h["capacity"]), f"{h['heartbeat_age_s']}s ago"]
                for h in snap["hosts"]] or [["-", "", "", "", ""]]),
        _table(["llm backend", "address", "status", "in flight", "capacity", "weights"],
               [[b["id"], b["address"], b["status"], str(b["in_flight"]), str(b["capacity"]), b["weight_version"]]
                for b in snap["backends"]] or [["-", "", "", "", "", ""]]),
        _table(["status", "jobs"], [[s, str(n)] for s, n in snap["jobs"].items()]),
    ]
    if snap.get("held"):
        sections.append(_table(["project", "rollouts in a stage", "sandboxes held", "pending"],
                               [[name, str(h["in_stages"]), str(h["sandboxes"]), str(h["pending"])]
                                for name, h in snap["held"].items()]))
    if snap.get("projects"):
        sections.append(_table(
            ["project", "ended jobs", "prompt tokens", "generated tokens", "llm calls", "llm s", "rollout s",
             "sandbox cpu s", "peak sandbox MiB"],
            [[name, *(f"{t.get(k, 0):.0f}" for k in ("jobs", "prompt_tokens", "generated_tokens", "llm_calls")),
              f"{t.get('llm_s', 0):.1f}", f"{t.get('total_s', 0):.1f}",
              f"{t['sandbox_cpu_s']:.1f}" if "sandbox_cpu_s" in t else "-",
              f"{t['sandbox_peak_memory_mb']:.0f}" if "sandbox_peak_memory_mb" in t else "-"]
             for name, t in snap["projects"].items()]))
    return "\n\n".join(sections)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)
