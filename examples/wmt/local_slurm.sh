#!/usr/bin/env bash
# A two-node SLURM cluster on this machine, to run the WMT recipe's --launcher slurm for real:
# nodes n1 and n2 on 127.0.0.1 (one slurmd each), partition "debug", munge authentication.
#
#   bash examples/wmt/local_slurm.sh start    # installs slurm-wlm and munge if missing (root)
#   export SLURM_CONF=/tmp/hrt-slurm/slurm.conf   # what `start` prints: sbatch, srun, sinfo read it
#   python examples/wmt/recipe.py --setup wmt16_en_ro --work W --slice --launcher slurm --nodes 2
#   bash examples/wmt/local_slurm.sh stop
#
# Commands: start | stop | status | install (the Debian packages only) | config (writes the munge
# key and slurm.conf, starts nothing: enough for scontrol's hostname expansion).
# State, configuration and daemon logs: $LOCAL_SLURM_DIR (default /tmp/hrt-slurm).
# Each node declares 2 CPUs whatever the machine has, so that 2 nodes x 1 task and 1 node x 2
# tasks are both schedulable on a small machine (the CPUs are shared, not reserved).
set -euo pipefail

PATH="$PATH:/usr/sbin:/sbin"  # the daemons, for users whose PATH lacks them
DIR="${LOCAL_SLURM_DIR:-/tmp/hrt-slurm}"
CONF="$DIR/slurm.conf"
SOCKET="$DIR/munge/munge.socket.2"
NODES=(n1 n2)
CTLD_PORT="${LOCAL_SLURM_PORT:-17000}"  # slurmd of node i listens on CTLD_PORT + i
export SLURM_CONF="$CONF"

say() { echo "[local_slurm] $*"; }
die() {
    echo "[local_slurm] $*" >&2
    exit 1
}

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
        return
    fi
    if [ "$(id -u)" -ne 0 ]; then
        die "SLURM is not installed and this is not root: run 'apt-get install slurm-wlm munge' as root, then $0 start"
    fi
    say "installing slurm-wlm and munge (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
}

write_config() {
    mkdir -p "$DIR/munge" "$DIR/state" "$DIR/log" "$DIR/spool"
    chmod 700 "$DIR/munge"
    if [ ! -s "$DIR/munge/munge.key" ]; then
        # munged refuses a key anyone else can read
        (umask 077 && head -c 1024 /dev/urandom >"$DIR/munge/munge.key")
    fi
    local host
    host="$(hostname -s)"
    {
        echo "# written by examples/wmt/local_slurm.sh: two nodes on 127.0.0.1"
        echo "ClusterName=hrt-local"
        echo "SlurmctldHost=$host(127.0.0.1)"
        echo "SlurmctldPort=$CTLD_PORT"
        echo "SlurmUser=$(id -un)"
        echo "SlurmdUser=$(id -un)"
        echo "AuthType=auth/munge"
        echo "AuthInfo=socket=$SOCKET"
        echo "CredType=cred/munge"
        echo "StateSaveLocation=$DIR/state"
        echo "SlurmdSpoolDir=$DIR/spool/%n"
        echo "SlurmctldPidFile=$DIR/slurmctld.pid"
        echo "SlurmdPidFile=$DIR/slurmd-%n.pid"
        echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
        echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
        # no cgroups in a container: plain process tracking, no task binding, no accounting
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "JobCompType=jobcomp/none"
        echo "MpiDefault=none"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_CPU"
        echo "SchedulerType=sched/backfill"
        # a node whose slurmd comes back after a stop returns to service by itself
        echo "ReturnToService=2"
        echo "SlurmdTimeout=60"
        echo "InactiveLimit=0"
        echo "KillWait=5"
        echo "MinJobAge=300"
        local i=1
        for node in "${NODES[@]}"; do
            echo "NodeName=$node NodeAddr=127.0.0.1 NodeHostname=$host Port=$((CTLD_PORT + i)) CPUs=2 State=UNKNOWN"
            i=$((i + 1))
        done
        echo "PartitionName=debug Nodes=$(
            IFS=,
            echo "${NODES[*]}"
        ) Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
    } >"$CONF.new"
    mv "$CONF.new" "$CONF"
}

# the node names must resolve: fairseq's SLURM init meets on tcp://<first node>:<port>
add_hosts() {
    local missing=()
    for node in "${NODES[@]}"; do
        getent hosts "$node" >/dev/null || missing+=("$node")
    done
    [ ${#missing[@]} -eq 0 ] && return
    [ -w /etc/hosts ] || die "the node names ${missing[*]} do not resolve and /etc/hosts is not writable: add '127.0.0.1 ${missing[*]}' to it as root"
    echo "127.0.0.1 ${missing[*]}  # examples/wmt/local_slurm.sh" >>/etc/hosts
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

running() {
    pid_alive "$DIR/munged.pid" && pid_alive "$DIR/slurmctld.pid" || return 1
    for node in "${NODES[@]}"; do pid_alive "$DIR/slurmd-$node.pid" || return 1; done
}

wait_idle() {
    local i
    for i in $(seq 60); do
        local idle
        idle="$(sinfo -h -N -p debug -o '%N %t' 2>/dev/null | grep -c ' idle$' || true)"
        [ "$idle" -eq "${#NODES[@]}" ] && return 0
        sleep 1
    done
    die "the nodes did not come up idle in 60 s ($(sinfo -h -N -o '%N %t' 2>&1 | tr '\n' ' ')); daemon logs: $DIR/log/"
}

start() {
    install_packages
    if running; then
        say "already running; export SLURM_CONF=$CONF"
        return
    fi
    stop quiet
    write_config
    add_hosts
    munged --key-file="$DIR/munge/munge.key" --socket="$SOCKET" --pid-file="$DIR/munged.pid" \
        --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" --force ||
        die "munged did not start; its log: $DIR/log/munged.log"
    # -c: a fresh controller state (no jobs of an earlier cluster in this folder)
    slurmctld -c -f "$CONF" || die "slurmctld did not start; its log: $DIR/log/slurmctld.log"
    for node in "${NODES[@]}"; do
        mkdir -p "$DIR/spool/$node"
        slurmd -N "$node" -f "$CONF" || die "slurmd -N $node did not start; its log: $DIR/log/slurmd-$node.log"
    done
    wait_idle
    say "nodes ${NODES[*]} idle in partition debug; export SLURM_CONF=$CONF"
}

stop() {
    local pidfile
    for pidfile in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid" "$DIR/munged.pid"; do
        if pid_alive "$pidfile"; then
            local pid
            pid="$(cat "$pidfile")"
            kill "$pid"
            for _ in $(seq 20); do
                kill -0 "$pid" 2>/dev/null || break
                sleep 0.5
            done
        fi
        rm -f "$pidfile"
    done
    [ "${1:-}" = quiet ] || say "stopped"
}

status() {
    if running; then
        say "running; export SLURM_CONF=$CONF"
        sinfo -N -o '%N %P %t %c'
    else
        say "not running (state folder $DIR)"
        return 1
    fi
}

case "${1:-}" in
start) start ;;
stop) stop ;;
status) status ;;
install) install_packages ;;
config)
    write_config
    say "wrote $CONF"
    ;;
-h | --help | help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' ;;
*) die "usage: $0 start|stop|status|install|config (state in \$LOCAL_SLURM_DIR, default /tmp/hrt-slurm)" ;;
esac
