#!/usr/bin/env bash
# Set up the software environment for hpc_ddp: a virtual environment with torch, submitit, psutil and the kit.
#
#   bash env/setup.sh            # .venv in the repository root
#   bash env/setup.sh --test     # also the test tools
#   HPC_DDP_VENV=/path bash env/setup.sh
#
# torch: if the Python that creates the venv already has torch (a cluster's module or CUDA build), the venv
# sees it through --system-site-packages and nothing is reinstalled. Otherwise, on a machine without an
# NVIDIA GPU, the CPU wheel torch==$HPC_DDP_TORCH is installed first; a GPU machine gets pip's default build.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${HPC_DDP_VENV:-$root/.venv}
python=${PYTHON:-python3}
torch_version=${HPC_DDP_TORCH:-2.13.0}
with_test=0
for arg in "$@"; do
  case $arg in
    --test) with_test=1 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "env/setup.sh: error: unknown option $arg (use --test or --help)" >&2; exit 2 ;;
  esac
done

if ! command -v "$python" >/dev/null; then
  echo "env/setup.sh: error: $python not found. Fix: install Python >= 3.10 or set PYTHON=/path/to/python3" >&2
  exit 2
fi
if [ ! -x "$venv/bin/python" ]; then
  if "$python" -c 'import torch' 2>/dev/null; then
    echo "[setup] $python already has torch $("$python" -c 'import torch; print(torch.__version__)'): reusing it"
    "$python" -m venv --system-site-packages "$venv"
  else
    "$python" -m venv "$venv"
  fi
fi
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
# The packages go in through uv (PyPI's `uv`, Astral's installer) where it can be had: it installs the same
# wheels as pip, from the same places, about five times faster (on the 2-core test VM the test tools took pip
# about 64 s, most of the test command's set-up; uv about 13 s). It reads pip's find-links and constraints as
# pip has them here (a machine's local wheels, its caps on torch). Without uv, or if it fails, pip does it.
# A venv that sees the system's torch (a cluster's CUDA build) keeps pip, which counts those packages as there.
# --compile-bytecode: pip writes every module's .pyc at install, uv only when asked. Without them, where
# PYTHONDONTWRITEBYTECODE is set (it is on this project's VMs and CI), every process compiles every module it
# imports, every time: importing torch took 6.6 CPU-s instead of 2.6, and CI ran the suite 2-6 times slower.
system_torch() { grep -qs '^include-system-site-packages = true' "$venv/pyvenv.cfg"; }
install() {
  if [ -z "${HPC_DDP_NO_UV:-}" ] && ! system_torch && { [ -x "$venv/bin/uv" ] || "${pip[@]}" uv >/dev/null 2>&1; }; then
    local links constraint
    links=${PIP_FIND_LINKS:-$("$venv/bin/python" -m pip config get global.find-links 2>/dev/null || true)}
    constraint=${PIP_CONSTRAINT:-$("$venv/bin/python" -m pip config get global.constraint 2>/dev/null || true)}
    if UV_FIND_LINKS=${UV_FIND_LINKS:-$links} UV_CONSTRAINT=${UV_CONSTRAINT:-$constraint} \
      "$venv/bin/uv" pip install --quiet --compile-bytecode --python "$venv/bin/python" "$@"; then
      return 0
    fi
    echo "[setup] uv could not install $*: trying pip" >&2
  fi
  "${pip[@]}" "$@"
}
wanted=(-r "$root/env/requirements.txt")
if [ "$with_test" = 1 ]; then
  wanted+=(-r "$root/env/requirements-test.txt")
fi
if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] NVIDIA GPU found: installing torch (CUDA build)"
    install torch
  else
    # Through pip, never uv: pip reads the machine's own configuration (its find-links, wherever they are set),
    # which is where the CPU wheel lies; uv knows none of it and, not handed it, takes PyPI's torch==2.13.0, a
    # CUDA build of about 3 GB that imports 2.5 times slower on the CPU. The rest then finds torch there.
    echo "[setup] no GPU: installing the CPU build torch==$torch_version"
    "${pip[@]}" "torch==$torch_version"
  fi
fi
install "${wanted[@]}"
# --no-deps: the dependencies are installed above, pinned; this never touches the torch already there.
install --no-deps -e "$root"
# The kit is imported from this tree (the editable install above), so its .pyc are written here, now, as the
# installers write every other package's. Where PYTHONDONTWRITEBYTECODE is set (this project's VMs and CI), no
# process writes them: every launcher, fork server, rank and Slurm task compiled the kit's modules again (a rank
# imports about 120 of them: 0.26 s of its start-up instead of 0.05). A .pyc older than its source is not
# used, only compiled again in memory: an edit never runs stale code. The test helpers too, with --test.
compiled=("$root/hpc_ddp")
[ "$with_test" = 1 ] && compiled+=("$root/tests")
# Only a speed-up: a module that does not compile here is compiled (and its error said) where it is imported.
"$venv/bin/python" -m compileall -q -j 0 "${compiled[@]}" >/dev/null ||
  echo "[setup] note: some of the kit's modules did not compile; \`python -m compileall $root/hpc_ddp\` says which" >&2
if ! command -v nvidia-smi >/dev/null && "$venv/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is None)'; then
  echo "[setup] note: torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') is a CUDA build on a machine without a GPU:" \
    "it runs on the CPU, but imports slower. Fix: rm -r $venv && bash env/setup.sh (the CPU wheel torch==$torch_version)" >&2
fi
echo "[setup] ready: $venv ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
