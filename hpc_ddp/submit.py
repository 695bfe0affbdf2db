"""Launch a DDP job: on Slurm through submitit, or `--local` on this machine with the same code path.

    python -m hpc_ddp.submit --local                        # 2 nodes x 2 processes here, gloo on CPU
    python -m hpc_ddp.submit --nodes 2 --gpus-per-node 4 --partition gpu --time 04:00:00 --folder /shared/runs/x
    python -m hpc_ddp.submit --nodes 2 --gpus-per-node 4 --print-sbatch   # show the script, submit nothing

One task per GPU (`--gpus-per-node G` gives G tasks per node); CPU jobs use `--gpus-per-node 0
--tasks-per-node T`. Every task runs `python -m hpc_ddp.train` with the training options below, derives its
rank from Slurm's variables, and global rank 0 writes checkpoints to --folder.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from hpc_ddp.config import TrainConfig, add_train_arguments, build_parser, from_namespace
from hpc_ddp.errors import UsageError, run_main

PROG = "python -m hpc_ddp.submit"


@dataclass(frozen=True)
class JobShape:
    """How many nodes and tasks, validated once for every path (local, submitit, print-sbatch)."""

    nodes: int
    gpus_per_node: int
    tasks_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


def job_shape(nodes: int, gpus_per_node: int, tasks_per_node: int | None) -> JobShape:
    if nodes <= 0:
        raise UsageError(f"--nodes {nodes}: must be at least 1")
    if gpus_per_node < 0:
        raise UsageError(f"--gpus-per-node {gpus_per_node}: must be 0 (CPU job) or more")
    if tasks_per_node is not None and tasks_per_node <= 0:
        raise UsageError(f"--tasks-per-node {tasks_per_node}: must be at least 1")
    if gpus_per_node > 0 and tasks_per_node not in (None, gpus_per_node):
        raise UsageError(f"--tasks-per-node {tasks_per_node} conflicts with --gpus-per-node {gpus_per_node}: "
                         "hpc_ddp runs one task per GPU. Drop --tasks-per-node (or use --gpus-per-node 0 for CPU)")
    tasks = gpus_per_node if gpus_per_node > 0 else (tasks_per_node or 2)
    return JobShape(nodes, gpus_per_node, tasks)


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    job = parser.add_argument_group("job shape")
    job.add_argument("--local", action="store_true",
                     help="run here: --nodes x tasks emulated nodes on this machine, gloo on CPU, with the "
                          "SLURM_* variables srun would set (no Slurm needed)")
    job.add_argument("--nodes", type=int, default=2, help="nodes (default: 2)")
    job.add_argument("--gpus-per-node", type=int, default=0,
                     help="GPUs per node; one task per GPU (default: 0, a CPU job)")
    job.add_argument("--tasks-per-node", type=int, default=None,
                     help="tasks per node for CPU jobs (default: 2 with --gpus-per-node 0, else = GPUs)")
    job.add_argument("--all-ranks", action="store_true",
                     help="--local: show every rank's output on the console, not just rank 0's progress")
    job.add_argument("--stop-grace-s", type=float, default=None, metavar="S",
                     help="--local: after Ctrl-C or SIGTERM the ranks save at the next agreed step and exit; any "
                          "still running S seconds later (stuck in user code or a collective) are killed, and "
                          "the launcher exits 130 (Ctrl-C) or 143 (SIGTERM). A second Ctrl-C kills at once "
                          "(default: 30)")
    job.add_argument("--doctor", action="store_true",
                     help="run `hpc_ddp.doctor` on every rank instead of training")
    job.add_argument("--collective", action="store_true",
                     help="with --doctor: also benchmark all-reduce (bus bandwidth by size, outlier ranks)")


def add_slurm_arguments(parser: argparse.ArgumentParser) -> None:
    slurm = parser.add_argument_group("Slurm (ignored with --local)")
    slurm.add_argument("--cpus-per-task", type=int, default=None, help="CPUs per task (default: Slurm's)")
    slurm.add_argument("--mem-gb", type=float, default=None, help="memory per node in GB")
    slurm.add_argument("--time", default="60", help="time limit: minutes, or [D-]HH:MM:SS (default: 60)")
    slurm.add_argument("--partition", default=None, help="partition (default: the cluster's default)")
    slurm.add_argument("--account", default=None, help="account to charge")
    slurm.add_argument("--qos", default=None, help="quality of service")
    slurm.add_argument("--constraint", default=None, help="node features, e.g. a100")
    slurm.add_argument("--exclusive", action="store_true", help="whole nodes only")
    slurm.add_argument("--job-name", default="hpc_ddp", help="job name (default: hpc_ddp)")
    slurm.add_argument("--setup", action="append", default=[], metavar="LINE",
                       help="shell line run before the tasks (module load, venv activation); repeatable")
    slurm.add_argument("--slurm", action="append", default=[], metavar="KEY=VALUE",
                       help="extra sbatch option, e.g. --slurm mail-type=END; repeatable")
    slurm.add_argument("--signal-delay-s", type=int, default=120,
                       help="seconds before the time limit that Slurm sends USR2 to every task (default: 120)")
    slurm.add_argument("--print-sbatch", action="store_true", help="print the sbatch script and submit nothing")
    slurm.add_argument("--wait", action="store_true",
                       help="follow rank 0's log until the job ends; exit with the job's status")


def build_argparser() -> argparse.ArgumentParser:
    parser = build_parser(PROG, __doc__ or "")
    add_job_arguments(parser)
    add_slurm_arguments(parser)
    add_train_arguments(parser)
    return parser


def gpu_count() -> int:
    """GPUs on this machine, without importing torch (nvidia-smi, else 0)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def check_folder(folder: Path) -> None:
    """Create the run folder and prove it is writable by writing to it (os.access lies for root)."""
    from hpc_ddp.train import prepare_folder  # light: no torch at import time

    prepare_folder(folder)
    (folder / "logs").mkdir(exist_ok=True)


def run_local(shape: JobShape, cfg: TrainConfig, all_ranks: bool, module: str,
              extra_argv: tuple[str, ...] = (), stop_grace_s: float | None = None) -> int:
    from hpc_ddp import local

    if stop_grace_s is not None and not (math.isfinite(stop_grace_s) and stop_grace_s >= 0):
        raise UsageError(f"--stop-grace-s {stop_grace_s:g}: must be 0 or more seconds (0 kills at once)")
    # Every line of the launcher goes through this console: one whose reader is gone (`| head`) must not
    # stop the run, nor stall a rank (hpc_ddp.local.Console).
    console = local.Console(sys.stdout)
    job_id = local.fresh_job_id()
    folder = Path(cfg.folder or os.path.join("runs", f"local-{job_id}"))
    check_folder(folder)
    cfg = cfg.with_folder(str(folder))
    extra = {}
    if shape.gpus_per_node > 0:
        have = gpu_count()
        if have < shape.nodes * shape.gpus_per_node:
            console.line(f"[launcher] --gpus-per-node {shape.gpus_per_node} x {shape.nodes} nodes asked, this "
                         f"machine has {have} GPU(s): running {shape.tasks_per_node} CPU processes per node with "
                         "gloo instead")
            extra["CUDA_VISIBLE_DEVICES"] = ""
    job = local.LocalJob(nodes=shape.nodes, tasks_per_node=shape.tasks_per_node, folder=folder,
                         train_argv=cfg.to_argv() + list(extra_argv), max_requeue=cfg.max_requeue,
                         all_ranks=all_ranks, job_id=job_id, module=module, extra_env=extra,
                         **({} if stop_grace_s is None else {"stop_grace_s": stop_grace_s}))
    console.line(f"[launcher] local job {job_id}: {shape.nodes} nodes x {shape.tasks_per_node} processes, run "
                 f"folder {folder}, per-rank logs in {folder / 'logs'}")
    return local.Launcher(job, console).run()  # which hands the console all it has before it returns


def main(argv: list[str] | None = None) -> int:
    ns = build_argparser().parse_args(argv)
    shape = job_shape(ns.nodes, ns.gpus_per_node, ns.tasks_per_node)
    cfg = from_namespace(ns)
    module = "hpc_ddp.doctor" if ns.doctor else "hpc_ddp.train"
    if ns.collective and not ns.doctor:
        raise UsageError("--collective is a doctor option: add --doctor (or drop --collective)")
    if ns.local:
        if ns.print_sbatch or ns.wait:
            raise UsageError("--print-sbatch and --wait are for Slurm jobs; drop them with --local")
        return run_local(shape, cfg, ns.all_ranks, module, ("--collective",) if ns.collective else (),
                         ns.stop_grace_s)
    from hpc_ddp import slurm_job

    return slurm_job.submit(ns, shape, cfg, module)


def cli() -> NoReturn:
    """The `hpc-ddp-submit` console script: as `python -m hpc_ddp.submit`, usage errors in one line, exit 2."""
    run_main(PROG, main)


if __name__ == "__main__":
    cli()
