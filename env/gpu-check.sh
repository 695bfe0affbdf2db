#!/usr/bin/env bash
# GPU checks, as one prepared script for a machine with an NVIDIA GPU and a CUDA build of torch.
# Runs from the repository root without installing hpc_ddp (PYTHONPATH), so it works with the machine's own
# torch; submitit is not needed for any of it. Output lines are meant to be pasted into a report.
#
#   bash env/gpu-check.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-${OUT:-/tmp/hpc_ddp-gpu-check}}
mkdir -p "$out"
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
status=0
echo "== versions"; nvidia-smi -L; "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
echo "== GPU tests"; "$py" -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/gpu-tests.log" || status=1
echo "== doctor (1 rank, --collective)"; "$py" -m hpc_ddp.doctor --collective --folder "$out/doctor" 2>&1 | tee "$out/doctor.log" || status=1
echo "== bench overhead"; "$py" -m hpc_ddp.bench --sections overhead --json "$out/bench.json" 2>&1 | tee "$out/bench.log" || status=1
exit $status
