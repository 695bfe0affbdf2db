"""One training task: `python -m hpc_ddp.train [training options]`.

Runs the same way under `srun` (one task per GPU), under torchrun, under `submit --local`, or alone:

    srun python -m hpc_ddp.train --epochs 10 --folder /shared/runs/exp1
    torchrun --nproc-per-node 4 -m hpc_ddp.train --folder runs/exp1
    python -m hpc_ddp.train                     # a single process

A task's start changes nothing in its run folder until everything has been checked: the task, the checkpoint
it resumes, every option; one run at a time holds a folder (`run.lock`).
"""

from __future__ import annotations

import signal

# Order matters: signal handlers first (a preemption signal can come before torch is even imported), then the
# cheap checks (flags, environment), then torch, placement, the process group, and training (run/session.py).
# The folder's lock is run/folder.py's hold_folder; resume.plan looks, resume.apply changes, and run.json is
# written last, only by a start that trains.
if __name__ == "__mp_main__":
    # A process a rank spawned runs this module under this name before its own work (multiprocessing's spawn
    # imports the parent's main module): DCP's saving process (--async-save process) ends with its rank.
    from hpc_ddp.run.checkpoint.dcpwrite import in_saving_process

    in_saving_process()

if __name__ == "__main__":
    # The very first instruction: a preemption signal that arrives while this task imports (before its
    # handler exists) waits, blocked, instead of killing it; preemption.install() unblocks and handles it.
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM))

import os  # noqa: E402
import sys  # noqa: E402
from typing import NoReturn

from hpc_ddp.cli import build_parser  # noqa: E402
from hpc_ddp.errors import run_task  # noqa: E402
from hpc_ddp.run import configfile, session  # noqa: E402
from hpc_ddp.run.config import add_train_arguments, from_namespace  # noqa: E402
from hpc_ddp.run.loop import preemption  # noqa: E402

PROG = "python -m hpc_ddp.train"
FOLDER_DEFAULT = "runs/<job id>, from the task's working directory; runs/single-<pid> outside a job"


def main(argv: list[str] | None = None) -> int:
    """The task's entry point, also called in-process inside Slurm jobs (TaskEntry); returns the exit code."""
    preemption.install()
    parser = build_parser(PROG, __doc__ or "")
    configfile.add_argument(parser)
    add_train_arguments(parser, FOLDER_DEFAULT)
    cfg = from_namespace(configfile.parse(parser, sys.argv[1:] if argv is None else argv))
    code = session.run(cfg, os.environ)
    preemption.ignore()  # done: the checkpoint and model are written; nothing left for a signal to save
    return code


def cli() -> NoReturn:
    """The `hpc-ddp-train` console script: `python -m hpc_ddp.train`, usage errors as one line and exit 2."""
    run_task(PROG, main)


if __name__ == "__main__":
    cli()
