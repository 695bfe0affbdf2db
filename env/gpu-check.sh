#!/usr/bin/env bash
# GPU checks, as one prepared script for a machine with an NVIDIA GPU and a CUDA build of torch.
# Runs from the repository root without installing hpc_ddp (PYTHONPATH), so it works with the machine's own
# torch; submitit is not needed for any of it. Output lines are meant to be pasted into a report.
#
#   bash env/gpu-check.sh [--cpu] [OUT_DIR]
#
# --cpu: no GPU needed. Skips the steps that need one (nvidia-smi, tests/test_gpu.py) and runs the rest in
# their shortest form (bench --quick: checks the step, measures nothing). tests/test_gpu_check.py runs this
# mode, so the script's commands cannot drift from the tools' command lines unnoticed.
set -uo pipefail
cpu=0
if [[ ${1:-} == --cpu ]]; then cpu=1; shift; fi
if [[ ${1:-} == -* ]]; then
  echo "env/gpu-check.sh: unknown option $1; usage: bash env/gpu-check.sh [--cpu] [OUT_DIR]" >&2
  exit 2
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-${OUT:-/tmp/hpc_ddp-gpu-check}}
mkdir -p "$out"
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
status=0
bench=(overhead --json "$out/bench.json")  # python -m hpc_ddp.bench --help: sections are positional
echo "== versions"
if [[ $cpu == 1 ]]; then
  "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' || status=1
else
  nvidia-smi -L; "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
fi
if [[ $cpu == 1 ]]; then
  echo "== GPU tests: skipped (--cpu)"
else
  echo "== GPU tests"; "$py" -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/gpu-tests.log" || status=1
fi
echo "== doctor (1 rank, --collective)"; "$py" -m hpc_ddp.doctor --collective --folder "$out/doctor" 2>&1 | tee "$out/doctor.log" || status=1
# FSDP2 on the GPUs here: NCCL, a CUDA mesh, bf16 mixed precision, a sharded checkpoint, a resume from it and
# its export to model.pth. --cpu: one gloo rank on the built-in linear task, no bf16.
if [[ $cpu == 1 ]]; then
  echo "== fsdp (1 CPU rank, linear)"; fsdp=(--gpus-per-node 1 --task linear)
else
  echo "== fsdp (NCCL, bf16, gpt)"; fsdp=(--gpus-per-node "$(nvidia-smi -L | wc -l)" --task gpt --amp bf16)
fi
fsdp+=(--local --nodes 1 --strategy fsdp --epochs 1 --save-every-steps 2 --folder "$out/fsdp" --log-every-s 0)
{ "$py" -m hpc_ddp.submit "${fsdp[@]}" --max-steps 2 && "$py" -m hpc_ddp.submit "${fsdp[@]}" --max-steps 4 &&
  "$py" -m hpc_ddp.checkpoint export "$out/fsdp/checkpoints/ckpt-00000004" "$out/fsdp/export.pth"; } 2>&1 |
  tee "$out/fsdp.log" || status=1
# --cpu: one rank a contender (tests/test_bench.py runs the section at 2): each rank's start costs seconds of CPU.
if [[ $cpu == 1 ]]; then echo "== bench overhead (--quick with --cpu)"; bench+=(--quick --world-size 1); else echo "== bench overhead"; fi
"$py" -m hpc_ddp.bench "${bench[@]}" 2>&1 | tee "$out/bench.log" || status=1
exit $status
