"""Every Redis key the service uses, built in one place.

All keys share the prefix ``prorl:`` so that one Redis can host the service beside other users,
and a scratch database can be wiped by pattern.
"""
from __future__ import annotations

PREFIX = "prorl"


def status_watch(watcher: str) -> str:
    """Set: the job ids one process's status watch reads (prorl_celery/watch.py)."""
    return f"{PREFIX}:watch:{watcher}"


def status_watch_changed(watcher_key: str) -> str:
    """Set: the watched jobs whose status changed since the watch's last reading (each status
    change adds its job to every watch that names it in :func:`job_watchers`)."""
    return f"{watcher_key}:changed"


def job_watchers(job_id: str) -> str:
    """Set: the changed-sets (:func:`status_watch_changed`) of the watches that read the job."""
    return f"{PREFIX}:job:{job_id}:watchers"


def job(job_id: str) -> str:
    """Hash: the job record (status, stage, instance, timings, result ...)."""
    return f"{PREFIX}:job:{job_id}"


def stage_lease(job_id: str) -> str:
    """String with a TTL: held by the worker running the job's current stage."""
    return f"{PREFIX}:job:{job_id}:lease"


def jobs_by_status(status: str) -> str:
    """Set of job ids currently in ``status``."""
    return f"{PREFIX}:status:{status}"


def group(group_id: str) -> str:
    """Set of job ids submitted with ``group_id``."""
    return f"{PREFIX}:group:{group_id}"


def fork_layer(name: str) -> str:
    """String (JSON) with a TTL: a group's prepared root, once frozen into the layer ``name``
    (tasks/harbor/fork.py): the job that prepared it, its size, its seconds."""
    return f"{PREFIX}:fork:{name}"


def fork_lock(name: str) -> str:
    """String with a TTL its holder renews: the token of the job preparing the layer ``name``."""
    return f"{PREFIX}:fork:{name}:lock"


def hosts() -> str:
    """Sorted set: sandbox host id -> time of its last heartbeat."""
    return f"{PREFIX}:hosts"


def host(host_id: str) -> str:
    """Hash: a sandbox host's address, token, runtimes, capacity and live count."""
    return f"{PREFIX}:host:{host_id}"


def job_counts() -> str:
    """Hash: "status|data_source" -> jobs (current for active statuses, totals for terminal)."""
    return f"{PREFIX}:counts"


def completions() -> str:
    """Stream: one entry per job reaching a terminal status, in completion order."""
    return f"{PREFIX}:completions"


def group_completions(group_id: str) -> str:
    """Stream: the completions of one group."""
    return f"{PREFIX}:completions:group:{group_id}"


def llm_backends() -> str:
    """Set of registered LLM backend ids."""
    return f"{PREFIX}:llm:backends"


def llm_backend(backend_id: str) -> str:
    """Hash: an LLM backend's address, protocol, capacity, status, weight version and counters."""
    return f"{PREFIX}:llm:backend:{backend_id}"


def llm_inflight(backend_id: str) -> str:
    """Sorted set: lease token -> expiry (ms) of each request in flight on the backend."""
    return f"{PREFIX}:llm:inflight:{backend_id}"


def llm_withdrawals() -> str:
    """Counter: raised whenever in-flight leases are withdrawn (a backend's removal, a drain or
    pause with abort); the lease keepers read it to learn when to look for their lost leases."""
    return f"{PREFIX}:llm:withdrawals"


def llm_sticky(job_id: str) -> str:
    """String with a TTL: the backend that served the job's last turn."""
    return f"{PREFIX}:llm:sticky:{job_id}"


def llm_sessions(backend_id: str) -> str:
    """Sorted set: job id -> last call (ms) of each live rollout whose prefix the backend holds."""
    return f"{PREFIX}:llm:sessions:{backend_id}"


def llm_probe_lock(backend_id: str) -> str:
    """String with a TTL: held by whoever is probing a quarantined backend right now."""
    return f"{PREFIX}:llm:probe:{backend_id}"


def _weights(project: str | None) -> str:
    """Each project's weight versions are its own (its trainer's policy); None: the operator's."""
    return f"{PREFIX}:weights" if not project else f"{PREFIX}:weights:project:{project}"


def weight_versions(project: str | None = None) -> str:
    """Hash: weight version name -> its ordinal (1, 2, ... in the order resumes named them)."""
    return f"{_weights(project)}:versions"


def weight_current(project: str | None = None) -> str:
    """String: the ordinal of the weight version the trainer resumed with last (the current policy)."""
    return f"{_weights(project)}:current"


def weight_unconsumed(project: str | None = None) -> str:
    """Sorted set: job id -> ordinal of the weight version current when the rollout was admitted,
    for every admitted rollout whose result the trainer has not consumed (acknowledged) yet."""
    return f"{_weights(project)}:unconsumed"


def compat_running(project: str | None = None) -> str:
    """String: present while the reference-compatible API is started (/start ... /stop)."""
    return f"{_compat(project)}:running"


def compat_jobs(project: str | None = None) -> str:
    """Set of job ids started by /process and not yet answered."""
    return f"{_compat(project)}:jobs"


def compat_label(label: str, project: str | None = None) -> str:
    """Set of the job ids /process started under the ``job_id`` label ``label``, not yet answered."""
    return f"{_compat(project)}:label:{label}"


def compat_label_last(label: str, project: str | None = None) -> str:
    """String with a TTL: the id of the job /process last started under the label ``label``."""
    return f"{_compat(project)}:label-last:{label}"


def stage_histogram(stage: str) -> str:
    """Hash: histogram of finished stage durations: "b:<bound>" counts the stages that took at
    most <bound> and more than the bound below it; "count", "sum"."""
    return f"{PREFIX}:metrics:stage:{stage}"


def sweep_counts() -> str:
    """Hash: sweep action -> how many times the sweep took it."""
    return f"{PREFIX}:metrics:sweep"


def rollout_calls(rollout_id: str) -> str:
    """List: a rollout's LLM calls, one packed record each (:mod:`prorl_celery.rollout.store`)."""
    return f"{PREFIX}:rollout:calls:{rollout_id}"


def rollout_messages(rollout_id: str) -> str:
    """List: a rollout's conversation, one JSON message each (:mod:`prorl_celery.rollout.store`)."""
    return f"{PREFIX}:rollout:messages:{rollout_id}"


def store_layout() -> str:
    """String, on the head's Redis: how many store shards its rollouts are spread over (0: none)."""
    return f"{PREFIX}:store:layout"


def store_shard_index() -> str:
    """String, on a store shard: its place in ``store_shards`` (from 0)."""
    return f"{PREFIX}:store:shard"


def rollout_fence(rollout_id: str) -> str:
    """String: the highest (attempt, stage) that saved into a rollout on a store shard (:func:`prorl_celery.shards.fence_of`)."""
    return f"{PREFIX}:rollout:fence:{rollout_id}"


def rollout_state(rollout_id: str) -> str:
    """Hash, on a store shard: the state a running stage last saved (``stage``, ``attempt``,
    ``state`` JSON) beside its rollout's lists (:mod:`prorl_celery.shards`)."""
    return f"{PREFIX}:rollout:state:{rollout_id}"


def job_counts_of(project: str) -> str:
    """Hash: as :func:`job_counts`, of one project's jobs only."""
    return f"{job_counts()}:project:{project}"


def project_sandboxes(project: str) -> str:
    """String: the sandboxes one project's jobs in init, run or eval may hold at once (the sum of
    their ``sandboxes`` needs). The transition script keeps it, building this key from
    :func:`job_counts_of`'s prefix (a project name has no colon: no project's counts hash is it)."""
    return f"{job_counts_of(project)}:sandboxes"


def projects() -> str:
    """Hash: project name -> its record (JSON: weight, created)."""
    return f"{PREFIX}:projects"


def project_keys() -> str:
    """Hash: API key id -> its record (JSON: project, salt, sha256 of salt and secret, created)."""
    return f"{PREFIX}:projects:keys"


def _compat(project: str | None) -> str:
    """The reference API's state of one project (None: the operator's, as before projects).
    A label has no colon (a job id's characters), so no label reaches into a project's keys."""
    return f"{PREFIX}:compat" if not project else f"{PREFIX}:compat:project:{project}"


def cost_totals(project: str) -> str:
    """Hash: one project's running cost totals (jobs, tokens, LLM calls and seconds, wall seconds)."""
    return f"{PREFIX}:metrics:cost:{project}"


def cost_projects() -> str:
    """Set: the projects that have cost totals."""
    return f"{PREFIX}:metrics:cost-projects"


def audit_verdict(content_hash: str) -> str:
    """String (JSON): the hack audit's verdict on one task's content (tasks/audit/quarantine.py)."""
    return f"{PREFIX}:audit:verdict:{content_hash}"


def regrade_workspace(job_id: str) -> str:
    """Hash with a TTL: a Harbor job's final workspace per step, kept for re-grading
    (``<step>.tar.gz``, ``<step>.json.gz``: :mod:`tasks.harbor.keep`)."""
    return f"{PREFIX}:regrade:{job_id}"


def audit_verdicts() -> str:
    """Set: the content hashes that have an audit verdict."""
    return f"{PREFIX}:audit:verdicts"


# -- fair share and quotas (prorl_celery/fairshare.py, prorl_celery/quotas.py) -----------------
def fair_active() -> str:
    """Sorted set: project -> its pass (virtual time) for every project with pending jobs."""
    return f"{PREFIX}:fair:active"


def fair_vtime() -> str:
    """String: the pass of the project chosen last (a project that becomes active starts there)."""
    return f"{PREFIX}:fair:vtime"


def fair_pending(project: str) -> str:
    """Sorted set: one project's jobs not yet released to the init queue, by priority then order."""
    return f"{PREFIX}:fair:pending:{project}"


def fair_pending_since(project: str) -> str:
    """Hash: pending job id -> when it was enqueued (ms) and its sandbox need: ``ms|need``."""
    return f"{PREFIX}:fair:pending-since:{project}"


def fair_waiting() -> str:
    """Set: released jobs of projects that wait in a stage queue (for init, or for their next stage)."""
    return f"{PREFIX}:fair:waiting"


def fair_held() -> str:
    """Hash: project -> since when (ms) a quota holds its next job, and which (``ms|quota``)."""
    return f"{PREFIX}:fair:held"


def fair_seq() -> str:
    """String: a counter ordering pending jobs of equal priority (first come, first released)."""
    return f"{PREFIX}:fair:seq"


def llm_project_inflight(project: str) -> str:
    """Sorted set: one project's LLM requests in flight (lease token -> expiry, ms)."""
    return f"{PREFIX}:llm:project-inflight:{project}"


def llm_project_tokens(project: str) -> str:
    """Hash: minute (epoch // 60) -> tokens one project's LLM calls used in it (the last hour kept)."""
    return f"{PREFIX}:llm:project-tokens:{project}"
