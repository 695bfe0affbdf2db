#!/usr/bin/env bash
# A real, local Slurm cluster on this one machine: munged, a private MariaDB, slurmdbd, slurmctld and one slurmd
# per emulated node (node1, node2, ...), each node in its own UTS namespace and on its own loopback address.
#
#   bash env/slurm/cluster.sh install|start|stop|status|env
#
# Settings (environment):
#   HPC_DDP_SLURM_DIR    state dir (conf, logs, pids, database, spool)   default /var/tmp/hpc-ddp-slurm
#   HPC_DDP_SLURM_NODES  number of emulated nodes      default: the running cluster's, else 3
#   HPC_DDP_SLURM_BESIDE 1: a second cluster beside the machine's first (started before it, with the same node
#                        count): its own state dir, daemons and ports; the first one's node names and addresses,
#                        /etc/hosts lines and /etc/slurm/slurm.conf link are left alone, so reach it with
#                        `eval "$(HPC_DDP_SLURM_DIR=... bash env/slurm/cluster.sh env)"`. Its job ids start at
#                        HPC_DDP_SLURM_FIRST_JOB_ID, so the rendezvous ports its jobs derive (hpc_ddp.cluster.env:
#                        10000 + id % 22768) are not the first one's. The test suite runs its Slurm files on two.
#   HPC_DDP_SLURM_FIRST_JOB_ID  a second cluster's first job id (its FirstJobId)  default 12000; give a third one
#                        beside them another (e.g. 6000), so that no two clusters' jobs derive the same ports
#
# Only processes this script started (recorded under $STATE/pids) are ever stopped; nothing is killed by name.
# See env/slurm/README.md.
set -euo pipefail

STATE=${HPC_DDP_SLURM_DIR:-/var/tmp/hpc-ddp-slurm}
NODES=${HPC_DDP_SLURM_NODES:-}
BESIDE=${HPC_DDP_SLURM_BESIDE:-0}
CLUSTER=hpcddp
PARTITION=debug
NODE_CPUS=4
NODE_MEM_MB=4096
WAIT_S=60
MARK="# hpc-ddp-slurm"
PACKAGES=(slurm-wlm slurmctld slurmd slurm-client slurmdbd munge mariadb-server mariadb-client)

CONF_DIR=$STATE/etc
CONF=$CONF_DIR/slurm.conf
# A second cluster stays one (its stop must leave the first one's /etc/hosts lines): remembered in its state.
if [[ $BESIDE == 1 ]]; then
  mkdir -p "$CONF_DIR" && touch "$CONF_DIR/beside"
elif [[ -f $CONF_DIR/beside ]]; then
  BESIDE=1
fi
DBD_CONF=$CONF_DIR/slurmdbd.conf
# The first job id of a second cluster: as given, else the one its configuration has (stop, status), else 12000.
FIRST_JOB_ID_BESIDE=${HPC_DDP_SLURM_FIRST_JOB_ID:-$(sed -n 's/^FirstJobId=//p' "$CONF" 2>/dev/null || true)}
FIRST_JOB_ID_BESIDE=${FIRST_JOB_ID_BESIDE:-12000}
if ! [[ $FIRST_JOB_ID_BESIDE =~ ^[1-9][0-9]*$ ]]; then
  printf '[slurm] ERROR: HPC_DDP_SLURM_FIRST_JOB_ID=%s: expected a job id above 0, e.g. 6000\n' "$FIRST_JOB_ID_BESIDE" >&2
  exit 2
fi
PORTS=$CONF_DIR/ports.env
if [[ -z $NODES ]]; then  # the count the cluster was started with (status, stop), else 3
  NODES=$(sed -n 's/^NODE_COUNT=//p' "$PORTS" 2>/dev/null || true)
  NODES=${NODES:-3}
fi
LOG=$STATE/log
PIDS=$STATE/pids
DB_DIR=$STATE/mysql
DB_SOCK=$DB_DIR/mysqld.sock
MUNGE_SOCK=/run/munge/munge.socket.2

export SLURM_CONF=$CONF

say() { printf '[slurm] %s\n' "$*"; }
die() { printf '[slurm] ERROR: %s\n' "$*" >&2; exit 1; }

node_names() { local i; for ((i = 1; i <= NODES; i++)); do echo "node$i"; done; }
node_addr() { echo "127.0.0.$(($1 + 1))"; }

tail_log() {  # tail_log FILE...: show the end of each log, for error messages
  local f
  for f in "$@"; do
    [[ -f $f ]] || continue
    printf -- '--- last lines of %s ---\n' "$f" >&2
    tail -n 12 "$f" >&2
  done
}

# ---------------------------------------------------------------- processes ---------------------------------------

proc_start_time() { awk '{print $22}' "/proc/$1/stat" 2>/dev/null; }
proc_state() { awk '{print $3}' "/proc/$1/stat" 2>/dev/null; }
proc_argv0() { tr '\0' '\n' <"/proc/$1/cmdline" 2>/dev/null | head -n 1 | xargs -r basename; }

record_pid() {  # record_pid NAME PID PROGRAM
  mkdir -p "$PIDS"
  echo "$2 $(proc_start_time "$2") $3" >"$PIDS/$1"
}

# is_ours NAME: the recorded process is alive (not a zombie), started when recorded, and still runs PROGRAM.
is_ours() {
  local f=$PIDS/$1 pid start prog
  [[ -f $f ]] || return 1
  read -r pid start prog <"$f" || return 1
  [[ -n $pid && -d /proc/$pid ]] || return 1
  [[ $(proc_state "$pid") != Z ]] || return 1
  [[ $(proc_start_time "$pid") == "$start" ]] || return 1
  [[ $(proc_argv0 "$pid") == "$prog" ]]
}

recorded_pid() { awk '{print $1}' "$PIDS/$1"; }

# launch NAME PROGRAM LOGFILE CMD...: start CMD detached (own session, stdin closed), record its PID.
# setsid, unshare (without --fork), sh -c 'exec ...' and setpriv all exec, so $! ends up being the daemon itself.
launch() {
  local name=$1 prog=$2 logfile=$3
  shift 3
  setsid "$@" </dev/null >>"$logfile" 2>&1 &
  record_pid "$name" "$!" "$prog"
}

# wait_for DESCRIPTION "NAME..." "LOG..." CHECK...: poll CHECK until it succeeds; fail fast if one of the named
# processes dies, or after WAIT_S seconds.
# shellcheck disable=SC2086  # $names and $logs are space-separated lists
wait_for() {
  local what=$1 names=$2 logs=$3 t0=$SECONDS name
  shift 3
  until "$@" >/dev/null 2>&1; do
    for name in $names; do
      if ! is_ours_or_exec "$name"; then
        tail_log $logs
        die "$what: process $name exited (see logs above)"
      fi
    done
    if ((SECONDS - t0 >= WAIT_S)); then
      tail_log $logs
      die "$what: not ready after ${WAIT_S}s"
    fi
    sleep 0.2
  done
}

# Right after launch the PID may still be mid-exec (setsid -> unshare -> sh -> slurmd): accept any live non-zombie.
is_ours_or_exec() {
  local pid
  pid=$(recorded_pid "$1")
  [[ -d /proc/$pid && $(proc_state "$pid") != Z ]]
}

stop_one() {  # stop_one NAME: SIGTERM the recorded process if it is still ours, wait, then SIGKILL.
  local name=$1 pid i
  [[ -f $PIDS/$name ]] || return 0
  if is_ours "$name"; then
    pid=$(recorded_pid "$name")
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
      is_ours "$name" || break
      sleep 0.1
    done
    if is_ours "$name"; then
      say "  $name (pid $pid) ignored SIGTERM for 10s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      for ((i = 0; i < 50; i++)); do is_ours "$name" || break; sleep 0.1; done
    fi
    say "stopped $name (pid $pid)"
  else
    say "$name: recorded process no longer running"
  fi
  rm -f "$PIDS/$name"
}

# ---------------------------------------------------------------- install -----------------------------------------

packages_installed() {
  local p s
  for p in "${PACKAGES[@]}"; do
    s=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null) || return 1
    [[ $s == "install ok installed" ]] || return 1
  done
}

cmd_install() {
  if packages_installed; then
    say "packages already installed: ${PACKAGES[*]}"
    return 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  local apt=(apt-get install -y --no-install-recommends -o Dpkg::Options::=--force-confold "${PACKAGES[@]}")
  # Refresh the package lists only when they are missing or older than a week, or when the install fails.
  if ! compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null \
    || [[ -z $(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages*' -mtime -7 -print -quit) ]]; then
    say "apt-get update (package lists missing or older than 7 days)"
    apt-get update -q || say "apt-get update failed; trying the install with the lists we have"
  fi
  say "apt-get install ${PACKAGES[*]}"
  if ! "${apt[@]}"; then
    say "install failed: apt-get update and retry"
    apt-get update -q
    "${apt[@]}"
  fi
  packages_installed || die "packages still missing after apt-get install"
  say "packages installed"
}

# ---------------------------------------------------------------- configuration -----------------------------------

port_in_use() {  # listening TCP sockets, IPv4 and IPv6, from /proc (works without ss/netstat)
  local hex
  hex=$(printf '%04X' "$1")
  awk -v p=":$hex" '$4 == "0A" && substr($2, length($2) - 4) == p {found = 1} END {exit !found}' \
    /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

TAKEN=" "
PICKED=
pick_port() {  # pick_port PREFERRED: sets PICKED to the first free port >= PREFERRED not already picked in this run
  local p=$1
  while port_in_use "$p" || [[ $TAKEN == *" $p "* ]]; do p=$((p + 1)); done
  TAKEN+="$p "
  PICKED=$p
}

any_daemon_running() {
  local f
  for f in "$PIDS"/*; do
    [[ -e $f ]] || continue
    is_ours "$(basename "$f")" && return 0
  done
  return 1
}

# Ports are picked when nothing of ours runs (previous choices preferred), and kept while anything runs.
choose_ports() {
  if [[ -f $PORTS ]] && any_daemon_running; then
    # shellcheck disable=SC1090
    source "$PORTS"
    [[ ${NODE_COUNT:-} == "$NODES" ]] \
      || die "cluster is running with $NODE_COUNT nodes; run 'stop' before changing HPC_DDP_SLURM_NODES to $NODES"
    return 0
  fi
  local prev_db=6850 prev_ctld=6817 prev_dbd=6819 prev_node=6830 i
  if [[ -f $PORTS ]]; then
    # shellcheck disable=SC1090
    source "$PORTS"
    prev_db=${DB_PORT:-6850} prev_ctld=${CTLD_PORT:-6817} prev_dbd=${DBD_PORT:-6819} prev_node=${NODE_PORT_1:-6830}
  fi
  pick_port "$prev_db" && DB_PORT=$PICKED
  pick_port "$prev_ctld" && CTLD_PORT=$PICKED
  pick_port "$prev_dbd" && DBD_PORT=$PICKED
  {
    echo "NODE_COUNT=$NODES"
    echo "DB_PORT=$DB_PORT"
    echo "CTLD_PORT=$CTLD_PORT"
    echo "DBD_PORT=$DBD_PORT"
  } >"$PORTS"
  for ((i = 1; i <= NODES; i++)); do
    pick_port $((prev_node + i - 1))
    echo "NODE_PORT_$i=$PICKED" >>"$PORTS"
  done
  # shellcheck disable=SC1090
  source "$PORTS"
}

write_conf() {
  local host i port
  host=$(hostname -s)
  {
    cat <<EOF
# Generated by env/slurm/cluster.sh: do not edit (rewritten on 'start' when the cluster is down).
ClusterName=$CLUSTER
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Requeued jobs wait for cred_expire (default 120 s) before they can start again: measured here, about 6 s
# from the requeue to the new allocation at 5, 12 s at 10.
AuthInfo=cred_expire=5
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups here; task/affinity would bind CPUs the nodes only claim to have.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
# Nodes claim CPUs=$NODE_CPUS on a smaller machine without being drained.
SlurmdParameters=config_overrides
KillWait=5
ReturnToService=2
MailProg=/bin/true
JobRequeue=1
PreemptType=preempt/none
PreemptMode=OFF
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$host
AccountingStoragePort=$DBD_PORT
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
MinJobAge=300
Waittime=0
EOF
    for ((i = 1; i <= NODES; i++)); do
      port=NODE_PORT_$i
      echo "NodeName=node$i NodeAddr=$(node_addr "$i") NodeHostname=node$i Port=${!port}" \
        "CPUs=$NODE_CPUS RealMemory=$NODE_MEM_MB State=UNKNOWN"
    done
    echo "PartitionName=$PARTITION Nodes=node[1-$NODES] Default=YES MaxTime=INFINITE State=UP"
    if [[ $BESIDE == 1 ]]; then echo "FirstJobId=$FIRST_JOB_ID_BESIDE"; fi
  } >"$CONF.tmp"
  mv "$CONF.tmp" "$CONF"

  [[ -f $CONF_DIR/db.pass ]] || (umask 077 && head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$CONF_DIR/db.pass")
  (
    umask 077
    cat >"$DBD_CONF" <<EOF
# Generated by env/slurm/cluster.sh
AuthType=auth/munge
DbdHost=$host
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
DebugLevel=info
LogFile=$LOG/slurmdbd.log
PidFile=$STATE/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(cat "$CONF_DIR/db.pass")
StorageLoc=slurm_acct_db
EOF
  )
}

link_etc_conf() {
  mkdir -p /etc/slurm
  local dst=/etc/slurm/slurm.conf
  if [[ -L $dst && $(readlink "$dst") == "$CONF" ]]; then return 0; fi
  if [[ -e $dst && ! -L $dst ]]; then
    mv "$dst" "$dst.before-hpc-ddp"
    say "moved existing $dst to $dst.before-hpc-ddp"
  fi
  ln -sfn "$CONF" "$dst"
  say "linked $dst -> $CONF"
}

update_hosts() {  # update_hosts add|remove: our marked lines only; /etc/hosts may be a bind mount, so rewrite in place
  local tmp i
  tmp=$(mktemp)
  grep -v -F "$MARK" /etc/hosts >"$tmp" || true
  if [[ $1 == add ]]; then
    for ((i = 1; i <= NODES; i++)); do echo "$(node_addr "$i") node$i $MARK" >>"$tmp"; done
  fi
  if ! cmp -s "$tmp" /etc/hosts; then
    cat "$tmp" >/etc/hosts
    say "/etc/hosts: $([[ $1 == add ]] && echo "node1..node$NODES -> 127.0.0.2.." || echo "removed our lines")"
  fi
  rm -f "$tmp"
}

# ---------------------------------------------------------------- daemons -----------------------------------------

munge_ok() { munge -n -S "$MUNGE_SOCK" 2>/dev/null | unmunge -S "$MUNGE_SOCK" >/dev/null 2>&1; }

start_munge() {
  if is_ours munged; then say "munged already running (pid $(recorded_pid munged))"; return 0; fi
  if munge_ok; then
    rm -f "$PIDS/munged"  # a record of ours from an earlier start is stale: stop must not act on it
    say "munged: using the one already serving $MUNGE_SOCK (not ours, will not stop it)"
    return 0
  fi
  [[ -s /etc/munge/munge.key ]] || { mungekey --create --keyfile=/etc/munge/munge.key && say "created munge key"; }
  chown munge:munge /etc/munge/munge.key
  install -d -o munge -g munge -m 755 /run/munge
  install -d -o munge -g munge -m 700 /var/lib/munge /var/log/munge
  rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock"
  launch munged munged "$LOG/munged.out" \
    setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged --foreground --socket="$MUNGE_SOCK"
  wait_for "munged" munged "$LOG/munged.out /var/log/munge/munged.log" munge_ok
  say "munged up (pid $(recorded_pid munged))"
}

# shellcheck disable=SC2120  # called with arguments through wait_for
db() { mariadb --no-defaults -S "$DB_SOCK" -u root "$@"; }

start_mariadb() {
  if is_ours mariadb; then say "mariadb already running (pid $(recorded_pid mariadb), port $DB_PORT)"; return 0; fi
  if [[ ! -d $DB_DIR/data/mysql ]]; then
    rm -rf "$DB_DIR/data"
    mkdir -p "$DB_DIR/data"
    say "initialising MariaDB data dir $DB_DIR/data"
    mariadb-install-db --no-defaults --user=root --datadir="$DB_DIR/data" --auth-root-authentication-method=socket \
      --skip-test-db >"$LOG/mariadb-install.log" 2>&1 || { tail_log "$LOG/mariadb-install.log"; die "mariadb-install-db failed"; }
  fi
  rm -f "$DB_SOCK"
  launch mariadb mariadbd "$LOG/mariadb.log" \
    mariadbd --no-defaults --user=root --datadir="$DB_DIR/data" --socket="$DB_SOCK" --pid-file="$DB_DIR/mariadb.pid" \
    --bind-address=127.0.0.1 --port="$DB_PORT" --skip-name-resolve --innodb-buffer-pool-size=32M \
    --innodb-log-file-size=16M --performance-schema=OFF --max-connections=50
  wait_for "mariadb" mariadb "$LOG/mariadb.log" db -e 'select 1'
  local pass
  pass=$(cat "$CONF_DIR/db.pass")
  # shellcheck disable=SC2119
  db <<EOF
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
FLUSH PRIVILEGES;
EOF
  say "mariadb up (pid $(recorded_pid mariadb), 127.0.0.1:$DB_PORT, socket $DB_SOCK)"
}

cluster_registered() { sacctmgr -n -P list cluster format=cluster 2>/dev/null | grep -qx "$CLUSTER"; }

start_slurmdbd() {
  if is_ours slurmdbd; then
    say "slurmdbd already running (pid $(recorded_pid slurmdbd))"
  else
    # slurmdbd finds slurmdbd.conf next to $SLURM_CONF.
    launch slurmdbd slurmdbd "$LOG/slurmdbd.out" /usr/sbin/slurmdbd -D
    wait_for "slurmdbd" slurmdbd "$LOG/slurmdbd.log $LOG/slurmdbd.out" sacctmgr -n list cluster
    say "slurmdbd up (pid $(recorded_pid slurmdbd), 127.0.0.1:$DBD_PORT)"
  fi
  if ! cluster_registered; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null
    say "registered cluster $CLUSTER in accounting"
  fi
}

start_slurmctld() {
  if is_ours slurmctld; then say "slurmctld already running (pid $(recorded_pid slurmctld))"; return 0; fi
  launch slurmctld slurmctld "$LOG/slurmctld.out" /usr/sbin/slurmctld -D -f "$CONF"
  wait_for "slurmctld" slurmctld "$LOG/slurmctld.log $LOG/slurmctld.out" sinfo -h
  say "slurmctld up (pid $(recorded_pid slurmctld), $(hostname -s):$CTLD_PORT)"
}

start_slurmd() {  # start_slurmd I
  local n=node$1 port=NODE_PORT_$1
  if is_ours "slurmd.$n"; then say "slurmd $n already running (pid $(recorded_pid "slurmd.$n"))"; return 0; fi
  mkdir -p "$STATE/spool/$n"
  if unshare --uts true 2>/dev/null; then
    # Own UTS namespace so that `hostname` inside jobs says nodeN.
    launch "slurmd.$n" slurmd "$LOG/slurmd.$n.out" \
      unshare --uts sh -c "hostname $n && exec /usr/sbin/slurmd -D -f '$CONF' -N $n"
  else
    say "WARNING: 'unshare --uts' fails here: jobs on $n will see hostname $(hostname) (SLURMD_NODENAME is still $n)"
    launch "slurmd.$n" slurmd "$LOG/slurmd.$n.out" /usr/sbin/slurmd -D -f "$CONF" -N "$n"
  fi
  say "slurmd $n launched (pid $(recorded_pid "slurmd.$n"), $(node_addr "$1"):${!port})"
}

node_states() { sinfo -h -N -p "$PARTITION" -o '%N %T' 2>/dev/null | sort -u; }

# All nodes up and schedulable: idle, or busy with jobs (allocated/mixed/completing), no '*' (not responding).
nodes_ready() {
  local states n
  states=$(node_states) || return 1
  [[ $(wc -l <<<"$states") -eq $NODES ]] || return 1
  while read -r n s; do
    [[ $s =~ ^(idle|allocated|mixed|completing)$ ]] || return 1
  done <<<"$states"
}

sacct_ok() { sacct -n -X -S now >/dev/null 2>&1; }

daemon_names() { echo munged mariadb slurmdbd slurmctld; node_names | sed 's/^/slurmd./'; }

healthy() {
  local d
  for d in $(daemon_names); do
    # munged: ours, or one already serving the socket (another cluster's, the system's); a record of ours
    # left by an earlier start whose munged is gone (a reboot) does not count against one that answers.
    if [[ $d == munged ]] && ! is_ours munged; then munge_ok || return 1; continue; fi
    is_ours "$d" || return 1
  done
  nodes_ready && sacct_ok
}

summary() {
  say "cluster '$CLUSTER' ready: nodes $(node_names | paste -sd, -) in partition '$PARTITION' (Default)," \
    "$NODE_CPUS CPUs each"
  if [[ $BESIDE == 1 ]]; then
    say "  conf:  $CONF (a second cluster: export SLURM_CONF=$CONF to use it; job ids from $FIRST_JOB_ID_BESIDE)"
  else
    say "  conf:  $CONF (linked from /etc/slurm/slurm.conf)"
  fi
  say "  state: $STATE  (logs in $LOG)"
  say "  ports: slurmctld $CTLD_PORT, slurmdbd $DBD_PORT, mariadb $DB_PORT, slurmd $(
    for ((i = 1; i <= NODES; i++)); do p=NODE_PORT_$i; printf '%s ' "node$i=$(node_addr "$i"):${!p}"; done)"
}

# ---------------------------------------------------------------- commands ----------------------------------------

cmd_start() {
  [[ $NODES =~ ^[1-9][0-9]*$ && $NODES -le 200 ]] || die "HPC_DDP_SLURM_NODES must be 1..200, got '$NODES'"
  [[ $(id -u) -eq 0 ]] || die "must run as root (installs packages, edits /etc/hosts, runs slurmd)"
  local t0=$SECONDS
  if [[ -f $PORTS ]] && packages_installed && any_daemon_running; then
    choose_ports
    if healthy; then
      say "already running and healthy ($NODES nodes, conf $CONF)"
      return 0
    fi
  fi
  packages_installed || cmd_install
  mkdir -p "$CONF_DIR" "$LOG" "$PIDS" "$STATE/run" "$STATE/ctld" "$STATE/spool" "$DB_DIR"
  choose_ports
  if ! any_daemon_running; then write_conf; say "wrote $CONF"; fi
  if [[ $BESIDE == 1 ]]; then
    # The first cluster's /etc/hosts lines give these nodes their addresses (each slurmd here listens on its own
    # port); without them a job's MASTER_ADDR=node1 would not resolve.
    getent hosts "node$NODES" >/dev/null \
      || die "HPC_DDP_SLURM_BESIDE=1 needs the first cluster's node names: start it first, with $NODES nodes"
  else
    link_etc_conf
    update_hosts add
  fi
  start_munge
  start_mariadb
  start_slurmdbd
  start_slurmctld
  local i
  for ((i = 1; i <= NODES; i++)); do start_slurmd "$i"; done
  local logs="$LOG/slurmctld.log" names="slurmctld" n
  for n in $(node_names); do logs+=" $LOG/slurmd.$n.out"; names+=" slurmd.$n"; done
  wait_for "nodes idle" "$names" "$logs" nodes_ready
  for n in $(node_names); do
    is_ours "slurmd.$n" || { tail_log "$LOG/slurmd.$n.log"; die "slurmd $n is not running"; }
  done
  say "nodes ready: $(node_states | paste -sd, -)"
  wait_for "sacct" "" "$LOG/slurmdbd.log $LOG/slurmctld.log" sacct_ok
  say "sacct answers"
  summary
  say "started in $((SECONDS - t0))s"
}

cmd_stop() {
  local d names
  names="$(node_names | sed 's/^/slurmd./') slurmctld slurmdbd mariadb munged"
  # Also nodes recorded by an earlier start with a larger HPC_DDP_SLURM_NODES.
  for d in "$PIDS"/slurmd.*; do
    [[ -e $d ]] || continue
    [[ " $names " == *" $(basename "$d") "* ]] || names="$(basename "$d") $names"
  done
  for d in $names; do stop_one "$d"; done
  [[ $BESIDE == 1 ]] || update_hosts remove  # a second cluster's nodes use the first one's lines
  say "stopped (state kept in $STATE; remove it for a fresh cluster: job ids restart at $([[ $BESIDE == 1 ]] && echo "$FIRST_JOB_ID_BESIDE" || echo 1))"
}

cmd_status() {
  local d ok=0
  # shellcheck disable=SC1090
  [[ -f $PORTS ]] && source "$PORTS"
  for d in $(daemon_names); do
    if is_ours "$d"; then
      say "$d: up (pid $(recorded_pid "$d"))"
    elif [[ $d == munged ]] && munge_ok; then
      say "munged: up (not started by this script)"
    else
      say "$d: DOWN"
      ok=1
    fi
  done
  local out
  if out=$(sinfo -N -o '%N %P %T %c %m' 2>&1); then echo "$out"; else say "sinfo: no answer"; ok=1; fi
  if ((ok == 0)); then
    nodes_ready || { say "nodes not all ready"; ok=1; }
    sacct_ok || { say "sacct: no answer"; ok=1; }
  fi
  if ((ok == 0)); then say "healthy"; else say "NOT healthy"; fi
  return "$ok"
}

cmd_env() {
  echo "export SLURM_CONF=$CONF"
}

case ${1:-} in
  install) cmd_install ;;
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  env) cmd_env ;;
  *) echo "usage: $0 install|start|stop|status|env" >&2; exit 2 ;;
esac
