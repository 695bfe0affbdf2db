#!/usr/bin/env bash
# Set up, start the local Slurm cluster, and run the whole test suite. Extra arguments go to pytest.
#
#   bash env/test.sh                 # everything (needs root for the local Slurm cluster)
#   HPC_DDP_NO_SLURM=1 bash env/test.sh   # without the Slurm cluster: its tests are skipped, not passed
#   bash env/test.sh -n 0            # in one process instead of 4 pytest-xdist workers
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# Chromium and the two local Slurm clusters are set up in the background while the virtual environment is
# (those wait on apt and on daemons, this on pip): about half a minute off the command. One chain, so that no
# two apt-get run at once (cluster.sh installs Slurm's packages on a fresh machine); its output follows once
# it is done. 3 nodes (cluster.sh's default): the retry tests take one away, or exclude one, and finish a
# 2-node job on the other two. The second cluster runs beside the first: the Slurm test files are split over
# the two (tests/workers.py), so the chain of Slurm tests, which mostly waits on slurmctld, runs as two chains
# side by side.
slurm=$([ "${HPC_DDP_NO_SLURM:-0}" != 1 ] && echo 1 || echo 0)
if [ "$slurm" = 1 ]; then
  export HPC_DDP_SLURM_DIR_2=${HPC_DDP_SLURM_DIR_2:-/var/tmp/hpc-ddp-slurm-2}
fi
background=$(mktemp -d)
(
  code=0
  bash env/chromium.sh || code=$?  # Debian's chromium, for the report's browser test
  echo "$code" >"$background/chromium"
  [ "$code" = 0 ] || [ "$code" = 2 ] || exit 1  # 2: not root, nothing to install with: that test is skipped
  if [ "$slurm" = 1 ]; then
    bash env/slurm/cluster.sh start
    HPC_DDP_SLURM_DIR=$HPC_DDP_SLURM_DIR_2 HPC_DDP_SLURM_BESIDE=1 bash env/slurm/cluster.sh start
  fi
) >"$background/log" 2>&1 &
started=$!
ready() {  # waits for the background chain and shows its output; non-zero if it failed
  local code=0
  wait "$started" || code=$?
  cat "$background/log"
  [ "$code" = 0 ] || echo "env/test.sh: setting up chromium or the Slurm clusters failed (above)" >&2
  return "$code"
}
bash env/setup.sh --test || { ready || true; exit 1; }
# Lint and format over the whole tree (pyproject's [tool.ruff]): one line per problem, before anything slow.
.venv/bin/python -m ruff check --quiet . && .venv/bin/python -m ruff format --check --quiet . || {
  echo "env/test.sh: ruff found the problems above. Fix: .venv/bin/python -m ruff check --fix . && .venv/bin/python -m ruff format ." >&2
  ready || true
  exit 1
}
ready || exit 1
if [ "$(cat "$background/chromium")" = 0 ]; then
  export HPC_DDP_REQUIRE_CHROMIUM=1  # the browser test fails instead of skipping without it
fi
if [ "$slurm" = 1 ]; then
  export HPC_DDP_REQUIRE_SLURM=1  # a Slurm test that cannot reach the cluster fails instead of skipping
fi
rm -rf "$background"
# 4 pytest-xdist workers by default (tests/workers.py decides who runs beside whom): the two Slurm chains, which
# mostly wait on slurmctld, on two, the local runs on the others (all four once the chains end); docs/tests.md's "Suite
# time" has the figures measured here. `bash env/test.sh -n 0` runs it in one process (later -n wins). Each run
# ends with the wall and CPU seconds per test file (tests/costs.py); --durations adds the slowest tests.
# PYTHONDONTWRITEBYTECODE (set on this project's VMs and CI) is lifted for the suite: pytest keeps its rewritten
# test modules only where bytecode may be written (each worker's collection 3.8 CPU-s instead of 8.6), and each
# of the suite's few thousand Python processes then compiles nothing that another one compiled before it.
exec env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -m pytest -n 4 --dist loadgroup --durations=20 "$@"
