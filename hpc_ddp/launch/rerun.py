"""The same command run again: which run folder it comes back to, and what may stop it there at once.

Without --folder, a training run's folder depends only on the command (hpc_ddp.run.folder: `runs/<task>` for
`submit --local`, `runs/<job name>-<task>` for a Slurm job), so the same command resumes the run it started.
Two things are refused at submission, in one line, before anything starts or queues:

- another run in that folder (other MUST_MATCH options: --seed, --batch-size...): it must not mix its
  checkpoints and records with that one's (`refuse_another_run`; the ranks would refuse it too, after
  starting, and on Slurm after waiting in the queue);
- on Slurm, a job of that folder that is still queued or running (`refuse_unfinished_job`): a rerun while
  the first job waits for its requeue would take the folder over, and the two jobs would take turns on it,
  each resuming the other's checkpoints. The batch shell's `begin` refuses the same in the job
  (hpc_ddp.launch.slurm.batch.taken_over), for `sbatch slurm/ddp.sbatch` reruns.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_ddp.errors import UsageError
from hpc_ddp.ledger import attempts
from hpc_ddp.run.config import TrainConfig, differences
from hpc_ddp.run.records import record

if TYPE_CHECKING:
    from hpc_ddp.scheduler.base import Scheduler


def refuse_another_run(folder: Path, cfg: TrainConfig, default_for: str) -> None:
    """Refuse a run with other MUST_MATCH options in `folder`, the default folder `default_for` says whose
    ("--task linear"), with the folder to use instead."""
    saved = record.read_config(folder)
    diffs = differences(saved, cfg) if saved is not None else []
    if diffs:
        n = 2
        while Path(f"{folder}-{n}").exists():
            n += 1
        raise UsageError(
            f"run folder {folder} (the default for {default_for}) holds another run, started with "
            f"{', '.join(diffs)}; a rerun there resumes that run, which needs the same values. Fix: "
            f"--folder {folder}-{n} (or any new folder) for this one, or the earlier values to resume that one"
        )


def unfinished_jobs(folder: Path) -> list[str]:
    """The jobs of `folder`'s attempts that may still run (pure but for reading attempts.jsonl): an attempt
    not closed, or closed with a requeue. Slurm says which really do."""
    last: dict[str, attempts.Attempt] = {}
    for a in attempts.read(folder):
        last[a.job] = a
    return [job for job, a in last.items() if a.ended is None or a.decision == "requeue"]


def refuse_unfinished_job(folder: Path, scheduler: Scheduler) -> None:
    """Refuse a submission into `folder` while one of its jobs is still queued or running (see the module
    docstring). A job the scheduler does not answer for is taken as over."""
    jobs = unfinished_jobs(folder)
    if not jobs:
        return
    queued = scheduler.queued(jobs) or {}
    for job in jobs:
        if job in queued:
            state, reason = queued[job]
            why = f" ({reason})" if reason and reason != "None" else ""
            raise UsageError(
                f"run folder {folder} belongs to job {job}, still {state.state}{why}: it resumes there by "
                f"itself, and a second job would take turns with it on the same checkpoints. Fix: follow it "
                f"(sacct -j {job}), or scancel {job} and run this again"
            )


def resume_command(argv: Sequence[str], python: str = sys.executable, cwd: str | None = None) -> str:
    """The command that resumes the run `argv` started: the same one, less what would start it over
    (`--resume never --overwrite` deletes the checkpoints, `--resume PATH` goes back to PATH), as a shell line.
    The interpreter is this one, relative to the working directory when it is under it (.venv/bin/python)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif arg != "--overwrite" and not arg.startswith("--resume="):
            kept.append(arg)
    here = os.path.abspath(cwd or os.getcwd())
    if python.startswith(here + os.sep):
        python = os.path.relpath(python, here)
    return shlex.join([python, "-m", "hpc_ddp.submit", *kept])
