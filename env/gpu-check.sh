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
# FSDP2 on the GPUs here: NCCL, a CUDA mesh, bf16 mixed precision, a sharded checkpoint, a resume from it that
# saves from DCP's saving processes (--async-save process: staged from the GPUs into shared memory), and the
# export to model.pth. --cpu: one gloo rank on the built-in linear task, no bf16.
if [[ $cpu == 1 ]]; then
  echo "== fsdp (1 CPU rank, linear)"; fsdp=(--gpus-per-node 1 --task linear)
else
  echo "== fsdp (NCCL, bf16, gpt)"; fsdp=(--gpus-per-node "$(nvidia-smi -L | wc -l)" --task gpt --amp bf16)
fi
fsdp+=(--local --nodes 1 --strategy fsdp --epochs 1 --save-every-steps 2 --folder "$out/fsdp" --log-every-s 0)
{ "$py" -m hpc_ddp.submit "${fsdp[@]}" --max-steps 2 && "$py" -m hpc_ddp.submit "${fsdp[@]}" --max-steps 4 --async-save process &&
  "$py" -m hpc_ddp.checkpoint export "$out/fsdp/checkpoints/ckpt-00000004" "$out/fsdp/export.pth"; } 2>&1 |
  tee "$out/fsdp.log" || status=1
# Meta-device construction: fsdp_tasks:no_dropout gives its model as a factory, so every rank builds it on the
# meta device and allocates only its shards on its GPU; the initial weights it writes (gathered) must be bitwise
# those of a CPU build of the same factory in one process (tests/meta_check.py). --cpu: one gloo rank.
if [[ $cpu == 1 ]]; then
  echo "== meta construction (1 CPU rank)"; meta=(--gpus-per-node 1)
else
  echo "== meta construction (NCCL)"; meta=(--gpus-per-node "$(nvidia-smi -L | wc -l)")
fi
meta+=(--local --nodes 1 --task fsdp_tasks:no_dropout --strategy fsdp --max-steps 1 --seed 7 --folder "$out/meta" --log-every-s 0)
{ INITIAL_OUT="$out/meta-initial.pt" "$py" -m hpc_ddp.submit "${meta[@]}" &&
  "$py" tests/meta_check.py "$out/meta-initial.pt" 7; } 2>&1 | tee "$out/meta.log" || status=1
# --cpu: one rank a contender, as tests/test_bench.py runs every section: each rank's start costs seconds of CPU.
if [[ $cpu == 1 ]]; then echo "== bench overhead (--quick with --cpu)"; bench+=(--quick --world-size 1); else echo "== bench overhead"; fi
"$py" -m hpc_ddp.bench "${bench[@]}" 2>&1 | tee "$out/bench.log" || status=1
exit $status
