#!/usr/bin/env bash
# Install and start a one-node Slurm cluster on this machine (tests/slurm_scripts/test_slurm.py uses it).
#
# Idempotent: installs slurm-wlm and munge with apt-get only if they are missing, writes
# /etc/slurm/slurm.conf for this host (its real hostname, CPUs and memory) unless a slurm.conf
# that this script did not write is already there, and starts munged, slurmctld and slurmd if they
# are not running. Needs root. The daemons are system services: they stay running afterwards
# (stop them with: kill $(cat /run/slurmd.pid) $(cat /run/slurmctld.pid)).
#
# Known to work in containers without systemd or cgroups: no cgroup.conf,
# ProctrackType=proctrack/linuxproc, TaskPlugin=task/none.
#
# Environment: SLURM_CONF (default /etc/slurm/slurm.conf), PRORL_SLURM_KILLWAIT (seconds between
# SIGTERM and SIGKILL when a job is cancelled; default 30, Slurm's default).
# Exit status: 0 ready, 2 not root / apt-get impossible (the caller may skip), 1 anything else.
set -euo pipefail

CONF=${SLURM_CONF:-/etc/slurm/slurm.conf}
MARK="# written by prorl-celery scripts/install-slurm.sh"
KILLWAIT=${PRORL_SLURM_KILLWAIT:-30}

say() { echo "install-slurm: $*" >&2; }

if [[ $(id -u) -ne 0 ]]; then
    say "must run as root (installs packages and starts system daemons)"
    exit 2
fi

# -- packages ---------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
        || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    if ! command -v apt-get >/dev/null; then
        say "slurm is not installed and apt-get is not available"
        exit 2
    fi
    export DEBIAN_FRONTEND=noninteractive
    say "installing slurm-wlm and munge with apt-get"
    if ! apt-get install -y -q slurm-wlm munge >/dev/null 2>&1; then
        apt-get update -q >/dev/null 2>&1 || { say "apt-get update failed (no network?)"; exit 2; }
        apt-get install -y -q slurm-wlm munge >/dev/null || { say "apt-get install failed"; exit 2; }
    fi
fi

# -- munge ------------------------------------------------------------------------------------
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    if command -v mungekey >/dev/null; then
        mungekey --create --keyfile=/etc/munge/munge.key
    else
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    say "starting munged"
    rm -f /run/munge/munged.pid
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n | unmunge >/dev/null || { say "munged does not answer"; exit 1; }
fi

# -- slurm.conf -------------------------------------------------------------------------------
HOST=$(hostname -s)
install -d -m 0755 "$(dirname "$CONF")" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
# `slurmd -C` prints this node's hardware as a NodeName line; keep CPUs and RealMemory.
HW=$(slurmd -C 2>/dev/null | head -1)
CPUS=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$HW")
MEM=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$HW")
CPUS=${CPUS:-$(nproc)}
MEM=${MEM:-$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)}

NEW=$(cat <<CONF
$MARK
# A one-node cluster for tests: no cgroups, no accounting; everything runs as root. Jobs that
# ask for it (--oversubscribe) may share CPUs, so a few small jobs fit on a small machine.
ClusterName=prorl
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
# Look at pending jobs (e.g. ones waiting on --dependency=after:<head>) every few seconds.
SchedulerParameters=bf_interval=5,sched_interval=10
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=$KILLWAIT
MinJobAge=300
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
)

changed=0
if [[ -f $CONF ]] && ! grep -qxF "$MARK" "$CONF"; then
    say "$CONF was not written by this script: leaving it alone"
elif [[ ! -f $CONF ]] || [[ $(cat "$CONF") != "$NEW" ]]; then
    say "writing $CONF (node $HOST, $CPUS CPUs, $MEM MB)"
    printf '%s\n' "$NEW" >"$CONF.tmp" && mv "$CONF.tmp" "$CONF"
    changed=1
fi

# -- daemons ----------------------------------------------------------------------------------
running() {  # running PIDFILE NAME: the pid in PIDFILE is alive and is NAME
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ -n $pid && $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]]
}
stop_daemon() {  # stop_daemon PIDFILE NAME
    local pid
    running "$1" "$2" || return 0
    pid=$(cat "$1")
    kill "$pid"
    for _ in $(seq 100); do [[ -d /proc/$pid ]] || return 0; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
}

if [[ $changed -eq 1 ]]; then
    stop_daemon /run/slurmd.pid slurmd
    stop_daemon /run/slurmctld.pid slurmctld
fi
if ! running /run/slurmctld.pid slurmctld; then
    say "starting slurmctld"
    slurmctld
fi
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
scontrol ping | grep -q UP || { say "slurmctld does not answer (see /var/log/slurm/slurmctld.log)"; exit 1; }
if ! running /run/slurmd.pid slurmd; then
    say "starting slurmd"
    slurmd
fi

# -- node ready -------------------------------------------------------------------------------
for _ in $(seq 150); do
    state=$(sinfo -h -n "$HOST" -o %T 2>/dev/null | head -1)
    case $state in
        idle|mixed|allocated|completing) break ;;
        drain*|down*|fail*)
            scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 0.2
done
state=$(sinfo -h -n "$HOST" -o %T 2>/dev/null | head -1)
case $state in
    idle|mixed|allocated|completing) say "ready: node $HOST is $state" ;;
    *) say "node $HOST is '${state:-unknown}' (see /var/log/slurm/slurmd.log)"; exit 1 ;;
esac
