#!/usr/bin/env bash
# A real four-node SLURM (node[1-4]) on this one machine, so tests and CI prove mscale's SLURM
# path against real srun/sbatch rather than a mock. How it works: docs/slurm.md.
#
#   scripts/slurm-local.sh start    install if missing, start munged/slurmctld/4×slurmd, wait idle
#                                   (a controller it starts forgets the jobs of earlier runs)
#   scripts/slurm-local.sh stop     stop exactly the daemons this script started
#   scripts/slurm-local.sh status   sinfo
#
# Needs root. Idempotent: a second start is a no-op; a daemon already running that this script
# did not start is used but never stopped (others may share the machine). What we started is
# recorded under $STATE, one file per daemon holding its pid.
set -euo pipefail

NODES=(node1 node2 node3 node4)
STATE=/run/mscale-slurm-local
CONF=/etc/slurm/slurm.conf
WAIT_S=${SLURM_LOCAL_WAIT_S:-60}
log() { echo "slurm-local: $*"; }

# pid_of NAME PIDFILE: the pid in PIDFILE if a live process named NAME holds it (not a stale file).
pid_of() {
  local pid
  pid=$(cat "$2" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ ]] && [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "$1" ] && echo "$pid"
}

install_packages() {
  [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ] \
    && command -v srun >/dev/null && return 0
  log "installing slurm-wlm munge (apt)"
  export DEBIAN_FRONTEND=noninteractive
  local out
  out=$(mktemp)
  if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge; } \
      >"$out" 2>&1; then
    tail -n 20 "$out"; rm -f "$out"; log "apt-get failed"; return 1
  fi
  rm -f "$out"
}

write_conf() {
  # NodeAddr/SlurmctldHost address 127.0.0.1 so that the host name need not resolve.
  local h tmp
  h=$(hostname -s)
  tmp=$(mktemp)
  cat >"$tmp" <<EOF
# Written by mscale scripts/slurm-local.sh: four emulated nodes on host $h.
ClusterName=local
SlurmctldHost=$h(127.0.0.1)
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SlurmctldPidFile=/run/slurmctld.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdPidFile=/run/slurmd-%n.pid
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
StateSaveLocation=/var/spool/slurmctld
SlurmUser=root
ReturnToService=2
MpiDefault=none
NodeName=node[1-4] NodeHostname=$h NodeAddr=127.0.0.1 Port=17001-17004 CPUs=2 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=node[1-4] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
  mkdir -p /etc/slurm
  if cmp -s "$tmp" "$CONF"; then rm -f "$tmp"; else mv "$tmp" "$CONF"; chmod 644 "$CONF"; fi
}

# start_daemon NAME PIDFILE CMD...: start CMD unless NAME already runs from PIDFILE; record it.
start_daemon() {
  local name=$1 pidfile=$2 tag=$3 pid i
  shift 3
  pid_of "$name" "$pidfile" >/dev/null && return 0
  STARTED=$((STARTED + 1))
  # Daemons detach; their stdio goes to a log so a caller capturing our output never hangs.
  "$@" </dev/null >>/var/log/slurm/daemons.out 2>&1 9>&-
  for ((i = 0; i < 100; i++)); do
    if pid=$(pid_of "$name" "$pidfile"); then echo "$pid" >"$STATE/$tag"; return 0; fi
    sleep 0.1
  done
  log "$tag did not start"; diagnose "$tag"; return 1
}

# diagnose [TAG]: node states and log tails (TAG slurmd-nodeK picks that node's log).
diagnose() {
  local node=${1:-slurmd-node1} f
  sinfo -N 2>&1 | head -n 8 || true
  for f in /var/log/munge/munged.log /var/log/slurm/slurmctld.log \
           "/var/log/slurm/slurmd-${node#slurmd-}.log" /var/log/slurm/daemons.out; do
    [ -f "$f" ] && { echo "--- $f"; tail -n 8 "$f"; }
  done
}

# all_up: sinfo lists node1..node4, each idle/mix/alloc (up and responding; no '*' suffix).
all_up() {
  local states
  states=$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u) || return 1
  [ "$(grep -cE '^node[1-4] (idle|mix|alloc)$' <<<"$states")" -eq 4 ]
}

start() {
  local t0=$SECONDS n
  STARTED=0
  install_packages
  mkdir -p "$STATE" /var/spool/slurmctld /var/log/slurm /run/munge
  for n in "${NODES[@]}"; do mkdir -p "/var/spool/slurmd/$n"; done

  [ -s /etc/munge/munge.key ] || mungekey -c -f >/dev/null
  chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
  chmod 400 /etc/munge/munge.key
  start_daemon munged /run/munge/munged.pid munged su -s /bin/sh munge -c /usr/sbin/munged

  write_conf
  # -c: a controller we start begins with no jobs. Its saved state may hold a job from a machine
  # that went down mid-test (an allocation whose srun is gone): recovered, it would hold all four
  # nodes 'alloc' forever (InactiveLimit 0, MaxTime INFINITE) and every later job would wait.
  start_daemon slurmctld /run/slurmctld.pid slurmctld /usr/sbin/slurmctld -c
  for n in "${NODES[@]}"; do
    start_daemon slurmd "/run/slurmd-$n.pid" "slurmd-$n" /usr/sbin/slurmd -N "$n"
  done

  local deadline=$((SECONDS + WAIT_S)) resumed=0
  until all_up; do
    if ((SECONDS >= deadline)); then
      log "node[1-4] not idle after ${WAIT_S}s"; diagnose; exit 1
    fi
    # A node drained by an earlier unclean stop (e.g. a killed job) never returns by itself.
    if ((!resumed)) && sinfo -h -N -o '%t' 2>/dev/null | grep -q drain; then
      scontrol update NodeName=node[1-4] State=RESUME 2>/dev/null || true; resumed=1
    fi
    sleep 0.5
  done
  if ((STARTED)); then log "up: node[1-4] idle; started $STARTED daemons ($((SECONDS - t0))s)"
  else log "already running: node[1-4] idle"; fi
}

# stop_tags TAG...: TERM the recorded daemons together (each takes ~2 s to exit), wait, forget.
stop_tags() {
  local tag pid i pids=()
  for tag in "$@"; do
    [ -f "$STATE/$tag" ] || continue
    pid=$(cat "$STATE/$tag")
    # Only a live process of the recorded name: a stale pid may now be someone else's.
    if [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "${tag%%-*}" ]; then
      kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
    fi
  done
  for pid in "${pids[@]}"; do
    for ((i = 0; i < 150; i++)); do [ -d /proc/"$pid" ] || break; sleep 0.1; done
    if [ -d /proc/"$pid" ]; then log "pid $pid ignored TERM; killing"; kill -KILL "$pid" || true; fi
  done
  for tag in "$@"; do rm -f "$STATE/$tag"; done
}

stop() {
  [ -n "$(ls -A "$STATE" 2>/dev/null)" ] || { log "nothing to stop"; return 0; }
  # slurmds before the controller, munged last: the others authenticate through it.
  stop_tags slurmd-node1 slurmd-node2 slurmd-node3 slurmd-node4
  stop_tags slurmctld
  stop_tags munged
  log "stopped"
}

[ "$(id -u)" -eq 0 ] || { log "must run as root"; exit 2; }
mkdir -p /run
exec 9>/run/mscale-slurm-local.lock
flock -w 300 9 || { log "another slurm-local.sh holds the lock"; exit 1; }
case ${1:-} in
  start) start ;;
  stop) stop ;;
  status) sinfo ;;
  *) echo "usage: $0 {start|stop|status}" >&2; exit 2 ;;
esac
