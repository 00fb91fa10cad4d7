# shellcheck shell=bash disable=SC2034  # PRORL_EXIT etc. are read by the sourcing scripts
# Shared by head.sbatch, workers.sbatch and worker_node.sh (sourced, not run).
#
# Every process of the stack is a child of the script that sourced this file and runs in the
# foreground of the batch step (or of an srun task): `scancel` reaches all of them, and nothing is
# left behind when the step ends. Components are started with `prorl_start NAME CMD...`, their
# pids recorded in "$PRORL_PID_FILE" ("NAME PID" lines); `prorl_supervise` waits until a signal
# arrives or a component exits, then the caller stops everything in order. A component given a
# restart command (`PRORL_RESTART[NAME]`, e.g. a store shard) is started again instead, at most
# PRORL_RESTART_MAX times (default 10); a restart command that fails stops everything.

PRORL_PYTHON=${PRORL_PYTHON:-python3}
PRORL_SUBMIT_DIR=${SLURM_SUBMIT_DIR:-$PWD}
PRORL_STATE_DIR=${PRORL_STATE_DIR:-$PRORL_SUBMIT_DIR/prorl-state}
PRORL_LOG_DIR=${PRORL_LOG_DIR:-$PRORL_STATE_DIR/logs}
PRORL_STOP_GRACE_S=${PRORL_STOP_GRACE_S:-20}
PRORL_HELPER="$PRORL_SLURM_DIR/prorl_slurm.py"
export PRORL_PYTHON PRORL_STATE_DIR PRORL_LOG_DIR PRORL_SLURM_DIR

declare -A PRORL_PIDS=()
declare -A PRORL_RESTART=() PRORL_RESTARTS=()
PRORL_RESTART_MAX=${PRORL_RESTART_MAX:-10}
PRORL_STOPPING=0
PRORL_EXIT=0

prorl_log() {
    printf '%s %s[%s]: %s\n' "$(date '+%F %T')" "$PRORL_ROLE" "$(hostname -s)" "$*" >&2
}

prorl_die() {
    prorl_log "error: $*"
    exit 1
}

prorl_helper() {
    "$PRORL_PYTHON" "$PRORL_HELPER" "$@"
}

prorl_cpus() {
    # CPUs Slurm gave this job on this node; outside Slurm, the machine's.
    local cpus=${SLURM_CPUS_ON_NODE:-}
    [[ $cpus =~ ^[0-9]+$ ]] || cpus=$(nproc)
    echo "$cpus"
}

prorl_alive() {
    # A child that exited stays a zombie until reaped: `kill -0` would still succeed on it.
    local stat
    stat=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
    [[ -n $stat && $stat != Z* ]]
}

prorl_descendants() {
    # All descendants of the given pids (children first found, deepest last).
    local frontier=("$@") found=() pid child
    while ((${#frontier[@]})); do
        pid=${frontier[0]}
        frontier=("${frontier[@]:1}")
        for child in $(ps -o pid= --ppid "$pid" 2>/dev/null); do
            found+=("$child")
            frontier+=("$child")
        done
    done
    echo "${found[@]}"
}

prorl_start() {
    # prorl_start NAME CMD...: run CMD in the background, output to its log file.
    local name=$1
    shift
    local log="$PRORL_LOG_DIR/$PRORL_LOG_PREFIX-$name.log"
    prorl_log "starting $name: $* (log: $log)"
    "$@" >>"$log" 2>&1 </dev/null &
    PRORL_PIDS[$name]=$!
    echo "$name $!" >>"$PRORL_PID_FILE"
}

prorl_on_signal() {
    if ((PRORL_STOPPING == 0)); then
        prorl_log "got SIG$1: stopping"
    fi
    PRORL_STOPPING=1
}

prorl_trap_signals() {
    trap 'prorl_on_signal TERM' TERM
    trap 'prorl_on_signal INT' INT
    trap 'prorl_on_signal HUP' HUP
    trap 'prorl_on_signal USR1' USR1
}

prorl_check_children() {
    local name
    for name in "${!PRORL_PIDS[@]}"; do
        if ! prorl_alive "${PRORL_PIDS[$name]}"; then
            local status= pid=${PRORL_PIDS[$name]}
            wait "$pid" 2>/dev/null && status=0 || status=$?
            ((status == 127)) && status="unknown"  # already reaped by `wait -n`
            prorl_restart "$name" "$status" && continue
            prorl_log "$name (pid $pid) exited (status $status): stopping"
            # (a restart that failed leaves its new pid recorded, for stop_all to stop)
            [[ ${PRORL_PIDS[$name]} == "$pid" ]] && unset "PRORL_PIDS[$name]"
            PRORL_STOPPING=1
            PRORL_EXIT=1
        fi
    done
}

prorl_restart() {
    # prorl_restart NAME STATUS: start NAME again with its PRORL_RESTART command; false when it has
    # none, used up PRORL_RESTART_MAX, the stack is stopping, or the command failed.
    local name=$1 count=$((${PRORL_RESTARTS[$1]:-0} + 1))
    [[ -n ${PRORL_RESTART[$name]:-} ]] && ((PRORL_STOPPING == 0)) || return 1
    if ((count > PRORL_RESTART_MAX)); then
        prorl_log "$name exited (status $2) after $PRORL_RESTART_MAX restarts: no more"
        return 1
    fi
    PRORL_RESTARTS[$name]=$count
    prorl_log "$name exited (status $2): starting it again ($count of $PRORL_RESTART_MAX)"
    eval "${PRORL_RESTART[$name]}" && return 0
    prorl_log "$name did not start again"
    return 1
}

prorl_supervise() {
    # prorl_supervise [POLL_S CHECK_CMD...]: return once a signal arrives, a component exits, or
    # CHECK_CMD (run every POLL_S seconds) fails.
    local poll=${1:-60} sleeper
    shift || true
    while ((PRORL_STOPPING == 0)); do
        sleep "$poll" &
        sleeper=$!
        wait -n  # returns when any child exits, or at once when a trapped signal arrives
        kill "$sleeper" 2>/dev/null
        # no `wait "$sleeper"`: after scancel's SIGTERM (the trap ran during `wait -n`, the
        # sleeper and the components died) bash 5.2 sat in a wait4(-1) there for good, and celery
        # beat, to which Slurm's linuxproc delivered no SIGTERM (seen: nothing pending, still
        # looping; its process name "[celery beat] -" has spaces, likely why), outlived the job;
        # bash reaps the sleeper by itself
        ((PRORL_STOPPING)) && break
        prorl_check_children
        if ((PRORL_STOPPING == 0 && $# > 0)) && ! "$@"; then
            prorl_log "check '$*' failed: stopping"
            PRORL_STOPPING=1
        fi
    done
}

prorl_stop() {
    # prorl_stop NAME...: SIGTERM them all at once, wait up to PRORL_STOP_GRACE_S, then SIGKILL
    # what is left together with all its descendants (sandbox shells of a hung sandbox host).
    local names=() pids=() name pid deadline left
    for name in "$@"; do
        pid=${PRORL_PIDS[$name]:-}
        [[ -n $pid ]] || continue
        names+=("$name")
        pids+=("$pid")
    done
    ((${#pids[@]})) || return 0
    prorl_log "stopping ${names[*]}"
    kill -TERM "${pids[@]}" 2>/dev/null
    deadline=$((SECONDS + PRORL_STOP_GRACE_S))
    while :; do
        left=()
        for pid in "${pids[@]}"; do prorl_alive "$pid" && left+=("$pid"); done
        ((${#left[@]} == 0 || SECONDS >= deadline)) && break
        sleep 0.2
    done
    if ((${#left[@]})); then
        prorl_log "still running after ${PRORL_STOP_GRACE_S}s, killing: ${left[*]}"
        # shellcheck disable=SC2046
        kill -KILL $(prorl_descendants "${left[@]}") "${left[@]}" 2>/dev/null
    fi
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
    for name in "${names[@]}"; do unset "PRORL_PIDS[$name]"; done
}
