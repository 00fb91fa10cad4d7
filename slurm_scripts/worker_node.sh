#!/usr/bin/env bash
# One prorl-celery worker node: a sandbox host and one Celery worker per queue (init, run, eval,
# maint), sized to the CPUs Slurm gave this job on this node. workers.sbatch runs it once per node
# with srun; it also runs by hand on any machine (`bash worker_node.sh HEAD_FILE`).
#
# It waits for the head's address file, starts everything in the foreground, and stops it all on
# SIGTERM (workers first, so that no new stage starts, then the sandbox host, which closes every
# sandbox it serves), when a component exits, or when the head job is gone (PRORL_FOLLOW_HEAD=1).
#
# Environment (all optional; see also head.sbatch):
#   PRORL_HEAD_FILE           the head's address file (or the first argument)
#   PRORL_HEAD_WAIT_S         how long to wait for the head (default 3600; 0: forever)
#   PRORL_FOLLOW_HEAD         1 (default): stop when the head job ends or its file goes away
#   PRORL_FOLLOW_HEAD_S       how often to look (default 60; each look runs squeue once)
#   PRORL_NODE_ADDR           address other nodes use to reach this node (default: the address
#                             of this node's route to the head's Redis, see sandboxes/host/advertise.py)
#   PRORL_NODE_QUEUES         queues served here (default "init run eval maint")
#   PRORL_SANDBOX_CAPACITY    sandboxes this node serves at once (default: 32 per CPU, at most
#                             available memory / 16 MiB; prorl_celery/ops/sizing.py)
#   PRORL_RUN_CONCURRENCY     threads of the run worker (default: the sandbox capacity)
#   PRORL_RUN_WORKER_PROCESSES  processes the run worker is started as (default 1), its threads
#                             split between them: the gateways of harness sessions live there, so
#                             a node with hundreds of them wants its cores (config/settings.py)
#   PRORL_RUN_WORKER_MEMORY_MB  memory limit of each run worker process, MiB, held by a memory
#                             cgroup of its own nested in the job's (default: half the node's,
#                             split between the processes; 0: none; needs root, else it is logged)
#   PRORL_INIT_CONCURRENCY, PRORL_EVAL_CONCURRENCY   (default: a quarter of it, 8 to 64)
#   PRORL_MAINT_CONCURRENCY   (default 2)
#   PRORL_SANDBOX_PORT        sandbox host port (default 0: any free port)
#   PRORL_SANDBOX_RUNTIMES    e.g. "bwrap,singularity" (default: all available here)
#   PRORL_SANDBOX_RUNTIME_CONFIG   JSON per runtime, e.g. '{"local": {"root": "/scratch/prorl"}}'
set -uo pipefail
umask 077

if [[ -z ${PRORL_SLURM_DIR:-} || ! -f ${PRORL_SLURM_DIR:-}/common.sh ]]; then
    PRORL_SLURM_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
fi
PRORL_ROLE="node"
# shellcheck source=common.sh
source "$PRORL_SLURM_DIR/common.sh" || exit 1

HEAD_FILE=${1:-${PRORL_HEAD_FILE:-$PRORL_SUBMIT_DIR/prorl-head.env}}
[[ $HEAD_FILE == /* ]] || HEAD_FILE="$PRORL_SUBMIT_DIR/$HEAD_FILE"
NODE=$(hostname -s)
NODE_ADDR=${PRORL_NODE_ADDR:-}
JOB_ID=${SLURM_JOB_ID:-local}
PRORL_LOG_PREFIX="node-$JOB_ID-$NODE"
PRORL_PID_FILE="$PRORL_LOG_DIR/$PRORL_LOG_PREFIX.pids"
mkdir -p "$PRORL_LOG_DIR" || prorl_die "cannot create $PRORL_LOG_DIR"
: >"$PRORL_PID_FILE"
"$PRORL_PYTHON" -c 'import prorl_celery' 2>/dev/null \
    || prorl_die "$PRORL_PYTHON cannot import prorl_celery: set PRORL_PYTHON to the right python"
prorl_trap_signals

# -- wait for the head (in the background, so that a signal interrupts the wait) -----------------
prorl_log "waiting for the head's address file $HEAD_FILE"
prorl_helper wait-head "$HEAD_FILE" --timeout "${PRORL_HEAD_WAIT_S:-3600}" >/dev/null &
waiter=$!
wait "$waiter"
status=$?
if ((PRORL_STOPPING)); then
    kill "$waiter" 2>/dev/null
    wait "$waiter" 2>/dev/null
    prorl_log "stopped while waiting for the head"
    exit 0
fi
((status == 0)) || prorl_die "no head (see above)"
# shellcheck disable=SC1090
source "$HEAD_FILE" || prorl_die "cannot read $HEAD_FILE"
export PRORL_REDIS_URL PYTHONUNBUFFERED=1
if [[ -n ${PRORL_STORE_SHARDS:-} ]]; then export PRORL_STORE_SHARDS; fi  # the head's store shards
if [[ -n ${PRORL_ROUTING_URL:-} ]]; then export PRORL_ROUTING_URL; fi  # the LLM routing's own Redis
unset PRORL_RESULT_URL
prorl_log "head job ${PRORL_HEAD_JOB_ID:-?} at ${PRORL_HEAD_HOST:-?}"

# -- sizing -------------------------------------------------------------------------------------
# The same plan as `prorl-celery up` (prorl_celery/ops/sizing.py): the sandbox capacity from this
# node's CPUs and available memory unless PRORL_SANDBOX_CAPACITY is set, the threads per queue
# from it unless PRORL_QUEUE_CONCURRENCY / PRORL_WORKER_CONCURRENCY say otherwise.
CPUS=$(prorl_cpus)
plan=$("$PRORL_PYTHON" -m prorl_celery.ops.sizing --cpus "$CPUS" --shell) || prorl_die "cannot size this node"
CAPACITY=$(sed -n 's/^CAPACITY=//p' <<<"$plan")
planned() { sed -n "s/^$1_CONCURRENCY=//p" <<<"$plan"; }
declare -A CONCURRENCY=(
    [init]=${PRORL_INIT_CONCURRENCY:-$(planned INIT)}
    [run]=${PRORL_RUN_CONCURRENCY:-$(planned RUN)}
    [eval]=${PRORL_EVAL_CONCURRENCY:-$(planned EVAL)}
    [maint]=${PRORL_MAINT_CONCURRENCY:-$(planned MAINT)}
)
read -r -a QUEUES <<<"${PRORL_NODE_QUEUES:-init run eval maint}"
prorl_log "$CPUS CPUs: $CAPACITY sandboxes; threads $(for q in "${QUEUES[@]}"; do
    printf '%s=%s ' "$q" "${CONCURRENCY[$q]:-?}"; done)"

# -- sandbox host -------------------------------------------------------------------------------
SANDBOX_PORT=${PRORL_SANDBOX_PORT:-0}
((SANDBOX_PORT == 0)) && SANDBOX_PORT=$(prorl_helper free-port)
READY_FILE="$PRORL_LOG_DIR/$PRORL_LOG_PREFIX-sandbox-host.json"
rm -f "$READY_FILE"
host_args=(--host 0.0.0.0 --port "$SANDBOX_PORT"
           --capacity "$CAPACITY" --host-id "$NODE-$SANDBOX_PORT" --ready-file "$READY_FILE")
# Without PRORL_NODE_ADDR the host publishes the address its route to Redis leaves from (what the
# head sees this node as), never a hostname that may resolve to loopback here.
[[ -n $NODE_ADDR ]] && host_args+=(--advertise "http://$NODE_ADDR:$SANDBOX_PORT")
[[ -n ${PRORL_SANDBOX_RUNTIMES:-} ]] && host_args+=(--runtimes "$PRORL_SANDBOX_RUNTIMES")
[[ -n ${PRORL_SANDBOX_RUNTIME_CONFIG:-} ]] && host_args+=(--runtime-config "$PRORL_SANDBOX_RUNTIME_CONFIG")
prorl_start sandbox-host "$PRORL_PYTHON" -m prorl_celery.ops.cli sandbox-host "${host_args[@]}"

WORKERS=()
stop_all() {
    ((${#WORKERS[@]})) && prorl_stop "${WORKERS[@]}"
    prorl_stop sandbox-host
    rm -f "$READY_FILE"
    prorl_log "stopped"
}

deadline=$((SECONDS + 60))
until [[ -s $READY_FILE ]]; do
    prorl_check_children
    if ((PRORL_STOPPING)) || ((SECONDS > deadline)); then
        stop_all
        ((SECONDS > deadline)) && prorl_die "the sandbox host did not come up"
        exit "$PRORL_EXIT"
    fi
    sleep 0.2
done
SANDBOX_URL=$("$PRORL_PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["address"])' \
    "$READY_FILE")
prorl_log "sandbox host on $SANDBOX_URL"

# -- one worker per queue -----------------------------------------------------------------------
# The run queue's worker may be several processes (PRORL_RUN_WORKER_PROCESSES), as `prorl-celery up`
# starts it (prorl_celery/ops/launcher.py): worker-run, worker-run-2, ... sharing its threads.
for q in "${QUEUES[@]}"; do
    [[ -n ${CONCURRENCY[$q]:-} ]] || { stop_all; prorl_die "unknown queue '$q' in PRORL_NODE_QUEUES"; }
    threads=${CONCURRENCY[$q]}
    procs=1
    [[ $q == run ]] && procs=${PRORL_RUN_WORKER_PROCESSES:-1}
    [[ $procs =~ ^[1-9][0-9]*$ ]] || { stop_all; prorl_die "PRORL_RUN_WORKER_PROCESSES must be a positive integer"; }
    ((procs > threads)) && procs=$threads
    for ((i = 1; i <= procs; i++)); do
        name=$q
        ((i > 1)) && name="$q-$i"
        prorl_start "worker-$name" "$PRORL_PYTHON" -m celery -A prorl_celery worker -Q "$q" \
            -n "$name-j$JOB_ID@%h" -c $((threads / procs + (i <= threads % procs))) \
            --loglevel INFO --without-mingle --without-gossip
        WORKERS+=("worker-$name")
    done
done
prorl_log "ready"

if [[ ${PRORL_FOLLOW_HEAD:-1} == 1 && -n ${PRORL_HEAD_JOB_ID:-} ]]; then
    prorl_supervise "${PRORL_FOLLOW_HEAD_S:-60}" prorl_helper head-alive "$HEAD_FILE" "$PRORL_HEAD_JOB_ID"
else
    prorl_supervise 60
fi
stop_all
exit "$PRORL_EXIT"
