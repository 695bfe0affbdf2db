"""`submit --sweep ...` on Slurm: the trials to run as one job array (`--array=0-N%P`), or several when the site's
MaxArraySize is smaller than the sweep.

Every element is a whole job of the kit, as a single submission is (hpc_ddp.launch.slurm.submitter): its tasks
run the trial's TaskEntry (submitit pickles one per element), and its batch shell's steps (`begin`, `end`:
hpc_ddp.launch.slurm.batch) supervise, requeue and restart that element alone. The batch script is one for the
whole array, so each element's shell first picks its trial's options by its index (`select_line`: the array's
file, `<sweep>/arrays/<first>.json`, read by hpc_ddp.launch.sweep.element). The element's id in Slurm's commands
and in its trial's records is ARRAY_INDEX (hpc_ddp.cluster.env.slurm_job_id): `scontrol requeue 123_4` requeues
that element alone.

MaxArraySize caps the index, not the count: a sweep of more trials is split into arrays of at most that many,
each indexed from 0, its file saying which trials (`chunks`: the offset is where the array's first trial is).
Slurm's throttle (`%P`) holds within one array: with --sweep-parallel, each array waits for the one before it
(`--dependency=afterany`), so that the sweep never runs more than P trials at once.
The cap is read from `scontrol show config`; Slurm's default, 1001, when it does not say.

submitit's files and the batch logs of every element are in `<sweep>/submitit`; each trial folder links its
`submitit` there, so that what reads a run's logs by its job id (`<folder>/submitit/<job>_0_log.out`) finds them.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_ddp import exitcodes
from hpc_ddp.launch import rerun
from hpc_ddp.launch.slurm import submitter
from hpc_ddp.launch.sweep import follow, state
from hpc_ddp.launch.sweep.trials import Trial
from hpc_ddp.run import folder as run_folder
from hpc_ddp.run.folder import atomic_write_bytes
from hpc_ddp.scheduler.slurm import env as slurm_env
from hpc_ddp.scheduler.slurm import runtime
from hpc_ddp.scheduler.slurm import submit as slurm_submit

if TYPE_CHECKING:
    from hpc_ddp.launch.options import LaunchOptions
    from hpc_ddp.launch.sweep.options import SweepArgs
    from hpc_ddp.scheduler.slurm.client import SlurmClient

ARRAYS = "arrays"
DEFAULT_MAX_ARRAY_SIZE = 1001  # Slurm's own default


def chunks(count: int, max_array_size: int) -> list[tuple[int, int]]:
    """(offset, size) of each array for `count` trials: indexes 0..size-1 stay below `max_array_size` (pure)."""
    cap = max(1, max_array_size)
    return [(offset, min(cap, count - offset)) for offset in range(0, count, cap)]


def select_line(python: str, file: Path) -> str:
    """The batch shell's first line of an element: its trial's options as "$@", and its id as $element."""
    module = f"{python} -m hpc_ddp.launch.sweep.element {shlex.quote(str(file))}"
    return f'{slurm_env.ELEMENT_LINE}\nopts=$({module}) || exit $?\neval "set -- $opts"  # this trial'


def array_record(trials: Sequence[Trial], offset: int) -> dict[str, object]:
    """What an array's file holds: its trials by index, each with the options its tasks and steps get."""
    return {"offset": offset, "trials": [{"name": t.name, "argv": t.cfg.to_argv()} for t in trials]}


def submission(
    launch: LaunchOptions, folder: Path, trials: Sequence[Trial], offset: int, stamp: str
) -> tuple[slurm_submit.Submission, Path]:
    """The array of `trials` (the sweep's from `offset`), and its file (written here)."""
    assert launch.slurm is not None
    request = launch.slurm.request
    file = folder / ARRAYS / f"{stamp}-{offset}.json"
    python = shlex.quote(runtime.batch_interpreter(request.runtime, sys.executable))
    first = trials[0].cfg
    job = slurm_submit.build(
        request, folder, folder / run_folder.SUBMITIT, (), first.max_requeue, select_line(python, file)
    )
    return job, file


def _link_logs(trial: Trial, folder: Path) -> None:
    run_folder.prepare(trial.folder, private=True)
    link = trial.folder / run_folder.SUBMITIT
    if not link.exists() and not link.is_symlink():
        link.symlink_to(folder / run_folder.SUBMITIT, target_is_directory=True)


def still_queued(trials: Sequence[Trial], client: SlurmClient) -> dict[str, str]:
    """The trials whose job may still run and that Slurm still has queued: {name: job} (one squeue)."""
    jobs = {job: t.name for t in trials for job in rerun.unfinished_jobs(t.folder)}
    queued = client.queued(list(jobs)) if jobs else {}
    return {jobs[job]: job for job in (queued or {})}


def submit(
    launch: LaunchOptions,
    folder: Path,
    decisions: Sequence[state.TrialPlan],
    args: SweepArgs,
    argv: Sequence[str],
) -> tuple[list[tuple[Trial, str]], int]:
    """Submit the trials `decisions` runs: (trial, element id) of each (and of each trial whose job is still
    queued, not submitted again), and the exit code so far (see the module docstring). --print-sbatch shows the
    first array's script and submits nothing."""
    assert launch.slurm is not None
    to_run = [d.trial for d in decisions if d.action == state.RUN]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if launch.slurm.print_sbatch:
        if to_run:
            job, file = submission(launch, folder, to_run[:DEFAULT_MAX_ARRAY_SIZE], 0, stamp)
            print(job.array_script(len(to_run), args.parallel or len(to_run)), end="")
            for i, t in enumerate(to_run):
                print(
                    f"# element {i}: python -m hpc_ddp.train {shlex.join(t.cfg.to_argv())}", file=sys.stderr
                )
        return [], exitcodes.OK
    slurm_submit.check_submit_host()
    client = submitter._client()
    queued = still_queued(to_run, client)
    for name, job in queued.items():
        print(f"[sweep] trial {name}: still queued as job {job}; it resumes by itself (not submitted again)")
    waiting = [(t, queued[t.name]) for t in to_run if t.name in queued]  # --wait follows them too
    to_run = [t for t in to_run if t.name not in queued]
    submitter.prepare_folder(folder)
    state.write_record(folder, [d.trial for d in decisions], argv)
    for t in to_run:
        _link_logs(t, folder)
    cap = client.max_array_size() or DEFAULT_MAX_ARRAY_SIZE
    submitted: list[tuple[Trial, str]] = []
    before: str | None = None  # the array submitted last, which a throttled one waits for
    for offset, size in chunks(len(to_run), cap):
        part = to_run[offset : offset + size]
        job, file = submission(launch, folder, part, offset, stamp)
        file.parent.mkdir(mode=0o700, exist_ok=True)
        atomic_write_bytes(file, (json.dumps(array_record(part, offset), indent=1) + "\n").encode())
        entries = [submitter.TaskEntry(submitter.TRAIN, tuple(t.cfg.to_argv())) for t in part]
        # Slurm's throttle (%P) holds within one array: with --sweep-parallel, each array of a split sweep starts
        # once the one before it has ended (afterany), so that no more than P trials of the sweep run at once.
        ids = client.submit_array(job, entries, args.parallel or size, before if args.parallel else None)
        before = follow.arrays(ids)[0]  # the array job id its elements share
        submitted += list(zip(part, ids, strict=True))
    for trial, job_id in submitted:
        print(f"[sweep] trial {trial.name}: submitted as job {job_id}", flush=True)
    return [*submitted, *waiting], exitcodes.OK
