"""The job store: one Redis hash per job, changed only through compare-and-set scripts
(:mod:`prorl_celery.jobscripts`).

Fields of the hash: ``job_id status stage_state data_source group_id project instance sampling_params
sandbox state result workers attempts faults attempt error digest sandboxes sandboxes_held`` (JSON
where structured; ``digest`` tells a retried submission from another request under its id,
:func:`request_digest`; ``sandboxes`` is the most sandboxes the job holds at once and
``sandboxes_held`` what its project's count holds for it while it is in a stage,
:mod:`prorl_celery.fairshare`) and the timing fields ``t_created t_enqueued t_stage_start
t_finished queue_s init_s run_s eval_s`` (seconds, floats); ``end_token``: written by the
transition that ended the job, removed once its cost counted in its project's totals
(:data:`prorl_celery.rollout.cost.ENDED`: exactly once). ``attempt`` counts runs from init (1 for
the first; an infrastructure fault sends the job back to ``queued`` for the next, see
:mod:`tasks.retry`); ``faults`` lists the attempts that ended that way; ``attempts`` counts
deliveries per stage within this attempt.

``status`` is one :class:`JobStatus` and changes only as :data:`status.TRANSITIONS` allows:
the store computes each change's allowed sources from that table, and the compare-and-set script
checks them atomically (a terminal status is final). ``stage_state`` is one :class:`StageState`:
while a stage executes, ``status`` names it and ``stage_state`` is ``running``; once it finished,
``stage_state`` is ``done`` until the next stage starts.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from enum import Enum
from typing import Any, Callable, Iterable, NamedTuple

import redis
from pydantic import BaseModel, Field

from prorl_celery import keys
from prorl_celery.jobscripts import ADMIT, CREATE, SAVE, STATUSES, TRANSITION, WATCHED_STATUSES
from prorl_celery.jobstate import INIT_WAIT_KEY
from prorl_celery.models import JobRequest, JobResult, JobView, Timings
from prorl_celery.redisio import text
from prorl_celery.shards import Shards, Since
from prorl_celery.status import PIPELINE, STAGES, TERMINAL, JobStatus, StageState, previous_stage, sources_for

log = logging.getLogger(__name__)
_JSON_FIELDS = ("instance", "sampling_params", "sandbox", "state", "result", "workers", "attempts",
                "faults", "error")
WATCH_TTL_S = 60
"""A status watch's sets lapse this long after its last reading (a watcher that died leaves nothing)."""
_TERMINAL_CSV = ",".join(s.value for s in TERMINAL)
_LIGHT_FIELDS = ("job_id", "status", "stage_state", "data_source", "group_id", "project", "sampling_params", "sandbox",
                 "workers", "attempts", "attempt", "t_created", "t_enqueued", "t_finished", "t_stage_start",
                 "queue_s", "init_s", "run_s", "eval_s", *("quota_wait_s", "quota_held"))  # fair share's
_VIEW_FIELDS = (*_LIGHT_FIELDS, "result")  # a finished job as the API shows it: not its state or instance
_STAGE_TIME_FIELDS = {JobStatus.INIT: "init_s", JobStatus.RUN: "run_s", JobStatus.EVAL: "eval_s"}
assert set(_STAGE_TIME_FIELDS) == set(STAGES)


def _dump(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def request_digest(req: JobRequest, project: str | None = None) -> str:
    """What tells a retry of a submission (same instance and sampling parameters, in any key order,
    by the same project) from a different request under the same job id: another project's
    identical request is a different one (409, never its job)."""
    body = {"instance": req.instance, "sampling_params": req.sampling_params}
    canonical = json.dumps({**body, "project": project} if project else body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class JobRecord(BaseModel):
    """A job as stored, decoded."""

    job_id: str
    status: JobStatus
    stage_state: StageState = StageState.NONE
    data_source: str
    group_id: str | None = None
    project: str | None = Field(None, description="The project whose key submitted it (None: the operator's token).")
    instance: dict[str, Any]
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    sandbox: dict[str, Any] | None = None
    state: dict[str, Any] = Field(default_factory=dict, description="A JobState's stored form (prorl_celery/jobstate.py).")
    result: dict[str, Any] | None = None
    workers: dict[str, str] = Field(default_factory=dict)
    attempts: dict[str, int] = Field(default_factory=dict)
    attempt: int = 1
    faults: list[dict[str, Any]] = Field(default_factory=list)
    t_created: float
    t_enqueued: float = 0.0
    t_finished: float = 0.0
    t_stage_start: float = 0.0
    queue_s: float = 0.0
    init_s: float = 0.0
    run_s: float = 0.0
    eval_s: float = 0.0
    quota_wait_s: float = Field(0.0, description="Held by a project quota before release (prorl_celery/fairshare.py).")
    quota_held: str | None = None

    @property
    def stage(self) -> str | None:
        return None if self.status is JobStatus.QUEUED or self.status.terminal else self.status.value

    def add_stage_time(self, stage: JobStatus, seconds: float) -> dict[str, float]:
        """Add ``seconds`` to the time of ``stage``; returns ``{field: new total}`` for the store."""
        field = _STAGE_TIME_FIELDS[stage]
        setattr(self, field, getattr(self, field) + seconds)
        return {field: getattr(self, field)}

    def stage_times(self) -> dict[str, float]:
        """Every stage's time, as the store's fields."""
        return {field: getattr(self, field) for field in _STAGE_TIME_FIELDS.values()}

    def timings(self) -> Timings:
        end = self.t_finished or time.time()
        waited = self.state.get(INIT_WAIT_KEY)  # a record read without its state: the result's
        if waited is None:
            waited = ((self.result or {}).get("timing") or {}).get("init_wait")
        return Timings(queue=self.queue_s, init=self.init_s, run=self.run_s, eval=self.eval_s,
                       total=round(end - self.t_created, 6), init_wait=float(waited or 0.0),
                       quota_wait=self.quota_wait_s, quota_held=self.quota_held)

    def view(self, result: dict[str, Any] | None = None) -> JobView:
        """The job as the API shows it; ``result``: the stored one as the trainer reads it
        (:func:`prorl_celery.rollout.views.job_views` builds it from the job's rollout)."""
        result = self.result if result is None else result
        return JobView(job_id=self.job_id, status=self.status, stage=self.stage, group_id=self.group_id,
                       project=self.project,
                       data_source=self.data_source, timings=self.timings(), workers=self.workers,
                       attempts=self.attempts, result=JobResult.model_validate(result) if result else None)


class Admission(NamedTuple):
    """:meth:`JobStore.admit`'s answer: the record as it was, whether the stage began, and if not
    why: ``done`` (a duplicate delivery), ``early`` (the previous stage still runs), ``leased``
    (another delivery holds the stage), '' (ended, or the table refused the change)."""

    record: JobRecord
    admitted: bool
    why: str


class JobStore:
    def __init__(self, client: redis.Redis, job_ttl_s: int = 7 * 86400, shards: Shards | None = None):
        self.redis = client  # the head's: job records, statuses, counts, completions
        self.shards = shards or Shards(client)  # where each job's rollout lives (prorl_celery/shards.py)
        self.job_ttl_s = job_ttl_s
        self._create = client.register_script(CREATE % {"ttl": job_ttl_s})
        self._transition = client.register_script(TRANSITION % {"terminal": _TERMINAL_CSV,
                                                                "watch_ttl": WATCH_TTL_S})
        self._admit = client.register_script(ADMIT % {"terminal": _TERMINAL_CSV, "watch_ttl": WATCH_TTL_S})
        self._statuses = client.register_script(STATUSES)
        self._watched = client.register_script(WATCHED_STATUSES)
        self._save = client.register_script(SAVE)

    # -- creation -------------------------------------------------------------------------
    def create_many(self, requests: Iterable[tuple[str, JobRequest]], project: str | None = None,
                    needs: list[int] | None = None) -> list[bool]:
        """Store new jobs as ``queued``, owned by ``project`` (None: the operator); returns, per
        job, whether it was new. ``needs``: per job, the most sandboxes it holds at once (the
        ``sandboxes`` field; none stored: 1), which a project's ``max_sandboxes`` counts."""
        pipe = self.redis.pipeline(transaction=False)
        now = time.time()
        for i, (job_id, req) in enumerate(requests):
            fields = {"job_id": job_id, "status": JobStatus.QUEUED.value, "stage_state": StageState.NONE.value,
                      "data_source": req.instance["data_source"], "group_id": req.group_id or "",
                      "instance": _dump(req.instance), "sampling_params": _dump(req.sampling_params),
                      "t_created": now, "t_enqueued": now, "attempt": 1,
                      "digest": request_digest(req, project), "project": project or ""}
            if needs is not None:
                fields["sandboxes"] = needs[i]
            counts_field = f"queued|{fields['data_source']}"
            flat = [job_id, counts_field] + [x for kv in fields.items() for x in kv]
            group_key = keys.group(req.group_id) if req.group_id else ""
            self._create(keys=[keys.job(job_id), keys.jobs_by_status("queued"), group_key, keys.job_counts(),
                               keys.job_counts_of(project) if project else ""], args=flat, client=pipe)
        return [bool(x) for x in pipe.execute()]

    def digests(self, job_ids: list[str]) -> list[str | None]:
        """Each job's :func:`request_digest` as stored (None: no such job, or one stored without it)."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(keys.job(job_id), "digest")
        return [text(d) if d else None for d in pipe.execute()]

    # -- reading --------------------------------------------------------------------------
    def get(self, job_id: str) -> JobRecord | None:
        raw = self.redis.hgetall(keys.job(job_id))
        return self._fresh_states([_decode(raw)])[0] if raw else None

    def get_many(self, job_ids: list[str], light: bool = False, view: bool = False) -> list[JobRecord | None]:
        """The records of ``job_ids``, in one round trip (and one per store shard for the states
        of running stages). ``light``: without the fields that grow with the job (``instance``,
        ``state``, ``result``, ``faults`` come back empty), for scans over every active job that
        look only at status, stage, timings and sandbox; ``view``: the light fields and the result
        (what :meth:`views` needs of a finished job)."""
        fields = _LIGHT_FIELDS if light else _VIEW_FIELDS if view else None
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            if fields:
                pipe.hmget(keys.job(job_id), fields)
            else:
                pipe.hgetall(keys.job(job_id))
        if not fields:
            return self._fresh_states([_decode(raw) if raw else None for raw in pipe.execute()])
        return [_decode({k: v for k, v in zip(fields, values) if v is not None}) if values[1] else None
                for values in pipe.execute()]

    def _fresh_states(self, records: list[JobRecord | None]) -> list[JobRecord | None]:
        """Sharded, a running stage saves its state on its rollout's shard, not here (see
        :mod:`prorl_celery.shards`): each record whose stage still runs (or was sent again) takes
        the state that stage saved there in its attempt, if it saved one."""
        if not self.shards.sharded:
            return records
        live = [r for r in records if r is not None and r.status in STAGES and r.stage_state is not StageState.DONE]
        if live:
            found = self.shards.stage_states([(r.job_id, r.status.value, r.attempt) for r in live])
            for record, state in zip(live, found):
                if state is not None:
                    record.state = json.loads(state)
        return records

    def status(self, job_id: str) -> JobStatus | None:
        value = self.redis.hget(keys.job(job_id), "status")
        return JobStatus(text(value)) if value else None

    def statuses(self, job_ids: list[str]) -> list[JobStatus | None]:
        """The status of each job (None: unknown), in one round trip."""
        if not job_ids:
            return []
        raw = self._statuses(keys=[keys.job(job_id) for job_id in job_ids])
        return [JobStatus(text(value)) if value else None for value in raw]

    def watched_statuses(self, watch_key: str, add: list[str], remove: list[str]
                         ) -> tuple[int, dict[str, JobStatus | None]]:
        """One reading of the watcher's set ``watch_key``, in one round trip: ``add`` joins it and
        ``remove`` leaves it; returns the set's size after that and the status (None: gone) of each
        added job and of each member whose status changed since the last reading (every status
        change names its job in its watchers' changed-sets). A size other than the caller's count
        of members says the set lapsed (no reading for ``WATCH_TTL_S``): add them all again."""
        suffix = keys.job_watchers("").removeprefix(keys.job(""))  # the job's key, then this
        raw = self._watched(keys=[watch_key, keys.status_watch_changed(watch_key)],
                            args=[keys.job(""), suffix, WATCH_TTL_S, self.job_ttl_s, len(add), *add, *remove])
        return int(raw[0]), {text(raw[i]): JobStatus(text(raw[i + 1])) if raw[i + 1] else None
                             for i in range(1, len(raw), 2)}

    def ids_in(self, status: JobStatus) -> list[str]:
        return sorted(text(x) for x in self.redis.smembers(keys.jobs_by_status(status.value)))

    def group_ids(self, group_id: str) -> list[str]:
        return sorted(text(x) for x in self.redis.smembers(keys.group(group_id)))

    def counts_by_source(self, project: str | None = None) -> dict[tuple[str, str], int]:
        """(status, data source) -> jobs: current for active statuses, totals for terminal ones;
        ``project``: of its jobs only."""
        raw = self.redis.hgetall(keys.job_counts_of(project) if project else keys.job_counts())
        return {tuple(text(k).split("|", 1)): int(v) for k, v in raw.items()}

    def counts(self, project: str | None = None) -> dict[str, int]:
        """Jobs per status: current for active statuses, totals for terminal ones; ``project``:
        of its jobs only."""
        out = {s.value: 0 for s in JobStatus}
        for (status, _), n in self.counts_by_source(project).items():
            out[status] = out.get(status, 0) + n
        return out

    # -- changing -------------------------------------------------------------------------
    def transition(self, job_id: str, target: JobStatus | None, *, sources: Iterable[JobStatus] | None = None,
                   require_state: StageState | None = None, expect: dict[str, Any] | None = None,
                   lease_token: str | None = None, take_lease_ms: int = 0,
                   before: Callable[[Any], None] | None = None,
                   after: Callable[[Any, bool], None] | None = None, **fields: Any) -> tuple[bool, JobStatus | None]:
        """Compare-and-set: move to ``target`` (None: keep) and set ``fields``, only if the job is
        not terminal, the table allows ``target`` after its status (narrowed to ``sources`` if
        given; with ``target`` None, ``sources`` alone), if given its ``stage_state`` equals
        ``require_state``, and each field of ``expect`` holds that value (e.g. ``{"attempt": 2}``:
        no write of an earlier attempt lands in a later one). Returns (changed, status after).
        ``lease_token``: a change that happens also releases the job's stage lease if it still
        holds that token, in the same step; with ``take_lease_ms``, the change takes the lease
        for that token instead (once its checks pass) and happens only if it got it.
        ``before``: queues commands of the caller's on a pipeline that is sent with this change
        in one round trip, ahead of it (a stage's histogram); they run once whatever the
        change's outcome. ``after(pipe, again)``: queues commands sent behind the change in the
        same round trip; each must tell for itself whether the change happened (a field the
        change wrote), and be harmless to run twice: if the change's script, or a script of
        theirs sent by digest, was missing (a Redis that lost its scripts), ``after`` is called
        once more with ``again`` True, after the change, to queue them with their scripts loaded.
        A failure of theirs is logged, not raised: the change's outcome is what this returns."""
        args = self._transition_args(target, sources, require_state, expect or {}, fields, lease_token,
                                     take_lease_ms)
        job_keys = [keys.job(job_id), keys.job_watchers(job_id), keys.stage_lease(job_id)]
        if before is None and after is None:
            return _changed(self._transition(keys=job_keys, args=args))
        pipe = self.redis.pipeline(transaction=False)
        if before is not None:
            before(pipe)
        at = len(pipe)
        pipe.evalsha(self._transition.sha, len(job_keys), *job_keys, *args)
        if after is not None:
            after(pipe, False)
        replies = pipe.execute(raise_on_error=False)
        reply = replies[at]
        missing = isinstance(reply, redis.exceptions.NoScriptError)
        if missing:  # a Redis that lost its scripts: once more
            reply = self._transition(keys=job_keys, args=args)
        elif isinstance(reply, Exception):
            raise reply
        if after is not None:
            if missing or any(isinstance(r, redis.exceptions.NoScriptError) for r in replies[at + 1:]):
                again = self.redis.pipeline(transaction=False)
                after(again, True)
                for r in again.execute(raise_on_error=False):
                    if isinstance(r, Exception):
                        log.warning("job %s: a command sent behind its change failed: %s", job_id, r)
            else:
                for r in replies[at + 1:]:
                    if isinstance(r, Exception):  # the change's outcome stands: what came behind is the caller's
                        log.warning("job %s: a command sent behind its change failed: %s", job_id, r)
        return _changed(reply)

    def admit(self, job_id: str, stage: JobStatus, worker: str, lease_token: str, lease_ms: int,
              now: float | None = None, **fields: Any) -> Admission | None:
        """A delivery of ``stage`` admitted in one round trip: the job read whole and, unless
        the delivery must not run, moved to the stage (``stage_state`` running, ``fields`` set)
        with its stage lease taken for ``lease_token``, the stage's count in ``attempts`` grown,
        ``worker`` written into ``workers`` and, unless the stage resumes, the wait since
        ``t_enqueued`` added to ``queue_s``. None for an unknown job; else the record as it was
        before, with its ``attempts`` and ``queue_s`` as the change wrote them when it happened."""
        now = time.time() if now is None else now
        later = ",".join(s.value for s in PIPELINE[PIPELINE.index(stage) + 1:-1])  # the terminal ones end it
        before = previous_stage(stage)
        args = [stage.value, later, before.value if before else "", worker, repr(now),
                *self._transition_args(stage, None, None, {}, {"stage_state": StageState.RUNNING, **fields},
                                       lease_token, lease_ms)]
        reply = self._admit(keys=[keys.job(job_id), keys.job_watchers(job_id), keys.stage_lease(job_id)], args=args)
        if reply[0] == -1:
            return None
        ok, why, raw = bool(reply[0]), text(reply[2]), reply[3]
        record = self._fresh_states([_decode(dict(zip(raw[::2], raw[1::2])))])[0]
        if ok:
            record.attempts, record.queue_s = json.loads(reply[4]), float(reply[5])
        return Admission(record, ok, why)

    def transition_many(self, changes: Iterable[tuple[str, JobStatus, dict[str, Any]]]
                        ) -> list[tuple[bool, JobStatus | None]]:
        """:meth:`transition` of many jobs, each ``(job_id, target, fields)`` with no condition
        but the table's, in one round trip (a bulk cancel)."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id, target, fields in changes:
            self._transition(keys=[keys.job(job_id), keys.job_watchers(job_id), keys.stage_lease(job_id)],
                             args=self._transition_args(target, None, None, {}, fields), client=pipe)
        return [_changed(reply) for reply in pipe.execute()]

    def _transition_args(self, target: JobStatus | None, sources: Iterable[JobStatus] | None,
                         require_state: StageState | None, expect: dict[str, Any],
                         fields: dict[str, Any], lease_token: str | None = None,
                         take_lease_ms: int = 0) -> list[Any]:
        state = StageState(require_state).value if require_state is not None else ""
        args = [_sources_csv(target, sources), target.value if target else "", state,
                keys.jobs_by_status(""), keys.job_counts(), self.job_ttl_s, keys.completions(),
                keys.group_completions(""), len(expect), keys.rollout_calls(""), keys.rollout_messages(""),
                keys.job_counts_of(""), lease_token or "", int(take_lease_ms) if lease_token else 0]
        for name, value in expect.items():  # a record from before attempts were counted has none
            args += [name, f"{value}," if name == "attempt" and str(value) == "1" else str(value)]
        for name, value in fields.items():
            if name == "stage_state":
                value = StageState(value)  # a value outside the vocabulary raises here
            if name in _JSON_FIELDS:
                value = _dump(value)
            args += [name, value.value if isinstance(value, Enum) else value]
        return args

    def save_state(self, job_id: str, stage: JobStatus, attempt: int, state: dict[str, Any],
                   saved: dict[str, int], calls: list[bytes], messages: list[str],
                   since: Since | None = None) -> bool:
        """Save a running stage's ``state`` and append to the job's rollout (its lists past the
        ``saved`` counts of calls and messages: a stray write of a delivery that lost the job
        is trimmed first), in one step. Unsharded: only while the job is in ``stage``, running,
        and in ``attempt`` (False when it is not: cancelled, ended, moved on). Sharded: on the
        rollout's shard alone, fenced there by attempt and stage (False behind a later one); the
        head is not written, and a cancel is noticed through the status watch
        (:mod:`prorl_celery.shards`)."""
        if self.shards.sharded:
            return self.shards.save(job_id, stage.value, attempt, _dump(state), saved, calls, messages,
                                    self.job_ttl_s, since)
        accepted = f"{attempt}," if attempt == 1 else str(attempt)  # a record from before attempts were counted
        args = [stage.value, accepted, saved.get("calls", 0), saved.get("messages", 0), len(calls), _dump(state),
                *calls, *messages]
        return bool(self._save(keys=[keys.job(job_id), keys.rollout_calls(job_id), keys.rollout_messages(job_id)],
                               args=args))

    def update(self, job_id: str, **fields: Any) -> bool:
        """Set fields on a job that is still active; False once it is terminal (or unknown)."""
        return self.transition(job_id, None, **fields)[0]


def _sources_csv(target: JobStatus | None, sources: Iterable[JobStatus] | None) -> str:
    """The statuses a change may start from, for the script ('' = any active one)."""
    allowed = sources_for(target) if target is not None else None
    if sources is not None:
        narrowed = frozenset(sources)
        if allowed is not None and not narrowed <= allowed:
            raise ValueError(f"the transition table never allows {target} after "
                             f"{sorted(s.value for s in narrowed - allowed)}")
        allowed = narrowed
    if allowed is None:
        return ""
    if not allowed:  # nothing may precede target: a csv that matches no status
        return "-"
    return ",".join(sorted(s.value for s in allowed))


def _changed(reply: list) -> tuple[bool, JobStatus | None]:
    ok, status = reply[0], reply[1]  # a third element: why not (the stage lease was held)
    status = text(status)
    return bool(ok), JobStatus(status) if status else None


def _decode(raw: dict) -> JobRecord:
    data: dict[str, Any] = {}
    for key, value in raw.items():
        key, value = text(key), text(value)
        if key in _JSON_FIELDS:
            data[key] = json.loads(value) if value else None
        else:
            data[key] = value
    data["group_id"] = data.get("group_id") or None
    data["project"] = data.get("project") or None
    data["instance"] = data.get("instance") or {}
    for name in ("state", "workers", "attempts"):
        data[name] = data.get(name) or {}
    data["faults"] = data.get("faults") or []
    data["attempt"] = data.get("attempt") or 1
    return JobRecord.model_validate(data)
