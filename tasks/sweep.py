"""The beat sweep: find work whose holder died and put it back on its feet.

Runs on the ``maint`` queue every ``sweep_interval_s``. A stage marked running whose lease lapsed
lost its worker: the sweep re-sends the chain from that stage (the redelivery resumes from the
saved state, or ends the job failed once the stage used up its attempts).
"""
from __future__ import annotations

import logging
import time
from typing import Any

from config.settings import get_settings
from prorl_celery import keys
from prorl_celery.celery_app import app
from prorl_celery.connections import get_store
from prorl_celery.jobs import JobStore
from prorl_celery.status import STAGES
from tasks.chain import stage_chain

log = logging.getLogger(__name__)


def recover_stalled_stages(store: JobStore, now: float | None = None) -> list[str]:
    """Re-dispatch stages whose lease lapsed; returns the job ids re-dispatched."""
    now = now or time.time()
    grace = get_settings().stage_lease_s
    redispatched = []
    for stage in STAGES:
        for job_id in store.ids_in(stage):
            record = store.get(job_id)
            if record is None or record.status is not stage or record.stage_state != "running":
                continue
            if now - record.t_stage_start < grace or store.redis.exists(keys.stage_lease(job_id)):
                continue
            ok, _ = store.transition(job_id, None, sources=[stage], require_state="running",
                                     stage_state="redispatched")
            if ok:
                stage_chain(job_id, record.data_source, start=stage).apply_async()
                redispatched.append(job_id)
    if redispatched:
        log.warning("sweep re-dispatched %d stalled stage(s): %s", len(redispatched), redispatched)
    return redispatched


@app.task(name="prorl.sweep")
def sweep() -> dict[str, Any]:
    """One sweep pass; returns what it did (also logged)."""
    report = {"redispatched": recover_stalled_stages(get_store())}
    log.info("sweep: %s", {k: len(v) for k, v in report.items()})
    return report
