#!/usr/bin/env bash
# Run a command under a wall-clock deadline. Past it: list the command's process tree, print each process's
# native and Python stacks (py-spy dump --native), kill the tree (TERM, then KILL) and exit 124.
#
#   bash env/deadline.sh [--label TEXT] SECONDS -- command [args...]
#
# The command runs in its own session (setsid); its tree is that process group plus every descendant by
# parent pid (the local launcher's ranks run in sessions of their own). Daemons that left the tree (the Slurm
# cluster's, started by setsid and reparented to init) are not touched. py-spy: $PY_SPY, else on PATH, else
# in the venv (bash env/setup.sh --test installs it); without it, only the process list is printed.
# SIGINT/SIGTERM to this script kill the tree the same way, without the stacks. Otherwise the exit status
# is the command's.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
label="[deadline] command"
if [[ ${1:-} == --label ]]; then label=$2; shift 2; fi
seconds=${1:-}
if [[ ! $seconds =~ ^[0-9]+$ || $seconds == 0 || ${2:-} != -- || $# -lt 3 ]]; then
  echo "env/deadline.sh: usage: bash env/deadline.sh [--label TEXT] SECONDS -- command [args...]" >&2
  exit 2
fi
shift 2
if ((seconds % 60 == 0)); then span="$((seconds / 60))-minute"; else span="$seconds-second"; fi

# Not a process group leader (no job control here), so setsid execs instead of forking, and so does env: $! is
# the command. env undoes the SIGINT/SIGQUIT ignoring that bash gives background commands (children inherit it).
if { true <&0; } 2>/dev/null; then
  setsid env --default-signal=INT,QUIT "$@" <&0 &
else
  setsid env --default-signal=INT,QUIT "$@" &
fi
pid=$!
sleep "$seconds" &
timer=$!

# The command's process group (pgid = its pid) and every descendant of it, by parent pid; one pid a line.
tree() {
  ps -e -o pid=,ppid=,pgid= | awk -v root="$pid" -v self="$$" '
    { parent[$1] = $2; if ($3 == root) keep[$1] = 1 }
    END {
      keep[root] = 1
      for (changed = 1; changed;) {
        changed = 0
        for (p in parent) if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; changed = 1 }
      }
      for (p in keep) if ((p in parent) && p != self) print p
    }' | sort -n
}

alive() { local state; state=$(ps -o stat= -p "$1" 2>/dev/null) && [[ $state != Z* ]]; }

py_spy() {
  local spy=${PY_SPY:-$(command -v py-spy || echo "${HPC_DDP_VENV:-$root/.venv}/bin/py-spy")}
  [[ -x $spy ]] && echo "$spy"
}

dump_stacks() {
  local spy p out
  (($#)) || { echo "$label: no process left to dump"; return; }
  echo "$label: the processes still running:"
  ps -o pid,ppid,pgid,stat,etime,wchan:24,args -p "$(IFS=,; echo "$*")" 2>&1
  if ! spy=$(py_spy); then
    echo "$label: py-spy not found, no stacks (bash env/setup.sh --test installs it into the venv)"
    return
  fi
  for p in "$@"; do
    echo "----- $label: py-spy dump --native --pid $p"
    if out=$(RUST_BACKTRACE=0 timeout 60 "$spy" dump --native --pid "$p" 2>&1); then
      echo "$out"
    else
      echo "(no Python stack: $(grep -m1 . <<<"$out"))"
    fi
  done
  echo "----- $label: end of stacks"
}

# TERM to the process group and the given pids, 5 s to end, then KILL to whatever of them and the tree is left.
kill_tree() {
  local live=("$@") p i
  kill -TERM -- "-$pid" "$@" 2>/dev/null
  for ((i = 0; i < 50 && ${#live[@]}; i++)); do
    sleep 0.1
    local candidates=("${live[@]}" $(tree))
    live=()
    for p in "${candidates[@]}"; do alive "$p" && live+=("$p"); done
  done
  kill -KILL -- "-$pid" "${live[@]}" $(tree) 2>/dev/null
  kill "$timer" 2>/dev/null
  wait "$pid" "$timer" 2>/dev/null
}

on_signal() {
  local pids
  trap - INT TERM
  mapfile -t pids < <(tree)
  echo "$label: interrupted by SIG$1: killing its ${#pids[@]} process(es)" >&2
  kill_tree "${pids[@]}"
  [[ $1 == INT ]] && exit 130
  exit 143
}
trap 'on_signal INT' INT
trap 'on_signal TERM' TERM

while :; do
  done_pid=
  wait -n -p done_pid "$pid" "$timer"
  status=$?
  if [[ $done_pid == "$pid" ]]; then
    kill "$timer" 2>/dev/null
    wait "$timer" 2>/dev/null
    exit "$status"
  fi
  [[ $done_pid == "$timer" ]] && break
  if [[ -z $done_pid && $status == 127 ]]; then echo "env/deadline.sh: lost track of the command" >&2; exit 1; fi
done

mapfile -t pids < <(tree)
echo "$label passed its $span deadline: stacks of its ${#pids[@]} process(es) follow, then they are killed"
dump_stacks "${pids[@]}"
mapfile -t -O "${#pids[@]}" pids < <(tree)
kill_tree "${pids[@]}"
echo "$label passed its $span deadline; killed its process tree; exit 124"
exit 124
