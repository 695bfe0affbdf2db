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
import sys
from typing import NoReturn

from hpc_ddp.cli import build_parser
from hpc_ddp.errors import UsageError, run_main
from hpc_ddp.launch import options
from hpc_ddp.launch.rerun import resume_command as resume_command
from hpc_ddp.launch.sweep import options as sweep_options
from hpc_ddp.run import configfile, taskspec
from hpc_ddp.run.config import BUILTIN_TASKS, add_train_arguments

PROG = "python -m hpc_ddp.submit"


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    job = parser.add_argument_group("job shape")
    job.add_argument(
        "--local",
        action="store_true",
        help="run here: --nodes x tasks emulated nodes on this machine, gloo on CPU, with the "
        "SLURM_* variables srun would set (no Slurm needed) (default: off: submit a Slurm job)",
    )
    job.add_argument("--nodes", type=int, default=2, help="nodes (default: 2)")
    job.add_argument(
        "--gpus-per-node", type=int, default=0, help="GPUs per node; one task per GPU (default: 0, a CPU job)"
    )
    job.add_argument(
        "--tasks-per-node",
        type=int,
        default=None,
        help="tasks per node for CPU jobs (default: 2 with --gpus-per-node 0, else = GPUs)",
    )
    job.add_argument(
        "--all-ranks",
        action="store_true",
        help="--local: show every rank's output on the console (default: off: rank 0's lines and the other "
        "ranks' warnings; every rank's output is in <folder>/logs/rank<N>.log either way)",
    )
    job.add_argument(
        "--stop-grace-s",
        type=float,
        default=None,
        metavar="S",
        help="--local: after Ctrl-C or SIGTERM the ranks save at the next agreed step and exit; any "
        "still running S seconds later (stuck in user code or a collective) are killed, and "
        "the launcher exits 130 (Ctrl-C) or 143 (SIGTERM). A second Ctrl-C kills at once "
        "(default: 30)",
    )
    job.add_argument(
        "--doctor",
        action="store_true",
        help="run `hpc_ddp.doctor` on every rank instead of training (default: off)",
    )
    job.add_argument(
        "--collective",
        action="store_true",
        help="with --doctor: also benchmark all-reduce (bus bandwidth by size, outlier ranks) (default: off)",
    )


def add_slurm_arguments(parser: argparse.ArgumentParser) -> None:
    slurm = parser.add_argument_group("Slurm (ignored with --local)")
    slurm.add_argument("--cpus-per-task", type=int, default=None, help="CPUs per task (default: Slurm's)")
    slurm.add_argument("--mem-gb", type=float, default=None, help="memory per node in GB (default: Slurm's)")
    slurm.add_argument("--time", default="60", help="time limit: minutes, or [D-]HH:MM:SS (default: 60)")
    slurm.add_argument("--partition", default=None, help="partition (default: the cluster's default)")
    slurm.add_argument("--account", default=None, help="account to charge (default: Slurm's, yours)")
    slurm.add_argument("--qos", default=None, help="quality of service (default: Slurm's)")
    slurm.add_argument("--constraint", default=None, help="node features, e.g. a100 (default: any)")
    slurm.add_argument("--exclusive", action="store_true", help="whole nodes only (default: off)")
    slurm.add_argument("--job-name", default="hpc_ddp", help="job name (default: hpc_ddp)")
    slurm.add_argument(
        "--setup",
        action="append",
        default=[],
        metavar="LINE",
        help="shell line run before the tasks (module load, venv activation); repeatable (default: none)",
    )
    slurm.add_argument(
        "--python",
        default=None,
        metavar="PATH",
        help="the python the tasks run (default: `python` as the --setup lines or the container leave it, "
        "else this interpreter's path)",
    )
    slurm.add_argument(
        "--srun-arg",
        action="append",
        default=[],
        metavar="OPTION",
        help="extra srun option, e.g. --srun-arg=--mpi=pmix (with `=`); repeatable (default: none)",
    )
    slurm.add_argument(
        "--container-image",
        default=None,
        metavar="IMAGE",
        help="run each task in this pyxis/enroot image (srun --container-image); the run folder is mounted "
        "(default: none: on the host)",
    )
    slurm.add_argument(
        "--container-mounts",
        default=None,
        metavar="SRC:DST[,...]",
        help="with --container-image: more mounts (srun --container-mounts) (default: the run folder only)",
    )
    slurm.add_argument(
        "--apptainer",
        default=None,
        metavar="IMAGE",
        help="run each task in this Apptainer/Singularity image (apptainer exec --nv, the run folder bound) "
        "(default: none: on the host)",
    )
    slurm.add_argument(
        "--slurm",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra sbatch option, e.g. --slurm mail-type=END; repeatable (default: none)",
    )
    slurm.add_argument(
        "--signal-delay-s",
        type=int,
        default=120,
        help="seconds before the time limit that Slurm sends USR2 to every task (default: 120)",
    )
    slurm.add_argument(
        "--print-sbatch",
        action="store_true",
        help="print the sbatch script and submit nothing (default: off)",
    )
    slurm.add_argument(
        "--wait",
        action="store_true",
        help="follow rank 0's log until the job ends; exit with the job's status (default: off: print the "
        "job id and how to follow it, and return)",
    )


# Where a run goes without --folder (hpc_ddp.run.folder: default_for_local_run, default_for_submission).
FOLDER_DEFAULT = (
    "--local: runs/<task>, e.g. runs/linear; a Slurm job: runs/<job-name>-<task>, absolute: the same command "
    "resumes there; --doctor: runs/doctor-<job-name>-<timestamp>"
)


def build_argparser() -> argparse.ArgumentParser:
    parser = build_parser(PROG, __doc__ or "")
    configfile.add_argument(parser)
    add_job_arguments(parser)
    add_slurm_arguments(parser)
    add_train_arguments(parser, FOLDER_DEFAULT)
    sweep_options.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sweep, argv = sweep_options.split(argv)  # a sweep's own flags; the rest is one run's command line
    if sweep.offset:
        raise UsageError("--sweep-offset is slurm/ddp.sbatch's (a split array); submit splits a sweep itself")
    if sweep.given:
        from hpc_ddp.launch.sweep import command

        return command.run(sweep, argv, build_argparser)
    if sweep.parallel is not None or sweep.retry_failed:
        raise UsageError("--sweep-parallel and --sweep-retry-failed go with --sweep or --sweep-file")
    launch, cfg = options.read(configfile.parse(build_argparser(), argv))  # every flag checked, once
    if launch.trains:  # --task mod:buidl is refused here, before any rank starts (its source read, never run)
        runtime = launch.slurm.request.runtime if launch.slurm is not None else None
        same = runtime is None or not (runtime.python or runtime.setup or runtime.container)
        taskspec.check(cfg.task, BUILTIN_TASKS, environment=same)
    if launch.local is not None:
        from hpc_ddp.launch import local

        return local.run_local(launch, cfg, resume_command(argv))
    from hpc_ddp.launch.slurm import submitter

    # The default run folder is the command's own: named in the advice, so that it resumes from anywhere.
    default = not cfg.folder and launch.trains
    again = [*argv, "--folder", str(submitter.default_folder(launch, cfg))] if default else argv
    return submitter.submit(launch, cfg, resume=resume_command(again))


def cli() -> NoReturn:
    """The `hpc-ddp-submit` console script: as `python -m hpc_ddp.submit`, usage errors in one line, exit 2."""
    run_main(PROG, main)


if __name__ == "__main__":
    cli()
