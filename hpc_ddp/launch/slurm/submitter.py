"""`python -m hpc_ddp.submit` on Slurm: build the job with submitit, submit it, and optionally follow it.

Layout of a run folder (`--folder`, on storage every node sees):

    <folder>/                    checkpoints/, model.pth, metrics.jsonl, run.json (written by the tasks)
    <folder>/submitit/           <job id>_submission.sh, <job id>_submitted.pkl (the pickled TaskEntry),
                                 <job id>_<rank>_log.out (one log per task), <job id>_<rank>_result.pkl

Both are created readable by the owner only: submitit unpickles, and so runs, what is in that folder.

Every task runs `TaskEntry`, which calls `hpc_ddp.train.main` with the validated training options; ranks are
derived inside by `hpc_ddp.cluster.env` from srun's variables, as on every other path.

Preemption. submitit installs its own handler for the preemption signal (USR2) before it calls the job: on
rank 0 alone it would checkpoint, `scontrol requeue` and exit, inside the handler, while the other ranks are
in a collective. `TaskEntry` and then `train.main` replace that handler first thing, so what happens is
hpc_ddp's: every rank agrees on a step, rank 0 saves once, all meet at a barrier, rank 0 requeues once. The
tasks then exit with `exitcodes.PREEMPTED` *without* a result file: submitit would read a result as "the job
is over" while the requeued run, which re-runs the same pickled `TaskEntry` and resumes from the folder's
latest checkpoint, is still to come.
"""

from __future__ import annotations

import importlib
import importlib.util
import shlex
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from hpc_ddp import exitcodes
from hpc_ddp.errors import UsageError, run_task
from hpc_ddp.launch import options, rerun
from hpc_ddp.launch.slurm.outcome import how_to_follow, log_path
from hpc_ddp.launch.slurm.outcome import read as _read  # noqa: F401  (tests read logs through it)
from hpc_ddp.run import folder as run_folder
from hpc_ddp.run.loop import preemption
from hpc_ddp.scheduler.slurm import submit as slurm_submit
from hpc_ddp.scheduler.slurm.request import SlurmRequest

if TYPE_CHECKING:
    from hpc_ddp.launch.options import LaunchOptions
    from hpc_ddp.launch.shape import JobShape
    from hpc_ddp.launch.slurm.lost import Policy
    from hpc_ddp.run.checkpoint.store import CheckpointStore
    from hpc_ddp.run.config import TrainConfig
    from hpc_ddp.scheduler.slurm.client import SlurmClient

SUBMITIT_DIR = run_folder.SUBMITIT
TRAIN = options.TRAIN  # what a training job's tasks run


@dataclass(frozen=True)
class TaskEntry:
    """What each task of the job runs (pickled by submitit): `<module>.main(argv)`, returning its exit code."""

    module: str
    argv: tuple[str, ...]

    def __call__(self) -> NoReturn:
        # First thing: take USR1/USR2/SIGTERM back from submitit (see the module docstring).
        preemption.install()
        main: Callable[[list[str]], int] = importlib.import_module(self.module).main

        def task() -> int:
            try:
                code = main(list(self.argv))
            except UsageError:
                raise  # one line in the task's log, as on the command line; no result file
            except Exception:
                _submitit_result("error", traceback.format_exc())  # failing_rank() orders ranks by its time
                raise
            if code == exitcodes.OK:
                _submitit_result("success", code)
            return code  # any other code: no result file, a requeued run may still come (see above)

        # The task ends here with os._exit, like `python -m hpc_ddp.train`: submitit never regains control,
        # so its result file (what it would write after we return) is written above.
        run_task(f"python -m {self.module}", task)


def _submitit_result(kind: str, value: object) -> None:
    """Write this task's result file as submitit's process_job does after the call returns or raises. Never
    raises: a folder that cannot take it (read-only, full) costs the file, not a second error over the
    task's own."""
    from submitit import JobEnvironment
    from submitit.core import utils

    try:
        with utils.temporary_save_path(JobEnvironment().paths.result_pickle) as tmp:
            utils.cloudpickle_dump((kind, value), tmp)
    except OSError:
        pass


def submission(
    request: SlurmRequest, folder: Path, module: str = "", argv: tuple[str, ...] = (), max_requeue: int = 0
) -> slurm_submit.Submission:
    """The job submitit submits (hpc_ddp.scheduler.slurm.submit), built once for both `--print-sbatch` and
    sbatch: a training job gets the batch shell's steps around srun (attempts, retries)."""
    steps = argv if module == TRAIN else None
    return slurm_submit.build(request, folder, folder / SUBMITIT_DIR, steps, max_requeue)


def sbatch_text(request: SlurmRequest, folder: Path, module: str = "", argv: tuple[str, ...] = ()) -> str:
    """The sbatch script submitit writes for this request (what `--print-sbatch` shows)."""
    return submission(request, folder, module, argv).script()


def prepare_folder(folder: Path) -> None:
    """Create the run folder and its submitit folder, owner-only; refuse one that others can write."""
    for path in (folder, folder / SUBMITIT_DIR):
        run_folder.prepare(path, private=True)


def submit(
    launch: LaunchOptions, cfg: TrainConfig, client: SlurmClient | None = None, resume: str = ""
) -> int:
    """The non-local path of `python -m hpc_ddp.submit`; returns the exit code. `launch` is checked already
    (hpc_ddp.launch.options); `client` asks Slurm how the job does (`--wait`, and whether a job of the run
    folder is still queued); `resume` is the command that resumes the run (the same one; `--folder` added when
    it was the default)."""
    assert launch.slurm is not None  # options.read gives a Slurm job its Slurm options
    shape, module, slurm = launch.shape, launch.module, launch.slurm
    if importlib.util.find_spec(module) is None:
        raise UsageError(f"{module} is not available in this installation of hpc_ddp")
    trains = launch.trains
    default = not cfg.folder
    folder = Path(cfg.folder).absolute() if cfg.folder else default_folder(launch, cfg)
    cfg = cfg.with_folder(str(folder))  # the tasks, and a requeued run, write to and resume from here
    argv = (*cfg.to_argv(), *launch.task_argv)
    job = submission(slurm.request, folder, module, argv, cfg.max_requeue)
    if slurm.print_sbatch:
        print(job.script(), end="")  # ends with a newline, as a file should
        print(f"# every task runs: python -m {module} {shlex.join(argv)}", file=sys.stderr)
        return exitcodes.OK
    slurm_submit.check_submit_host()
    client = client or _client()
    if trains:
        if default and not cfg.overwrite:
            rerun.refuse_another_run(folder, cfg, f"--job-name {slurm.job_name} --task {cfg.task}")
        rerun.refuse_unfinished_job(folder, client)
    existed = folder.exists()
    prepare_folder(folder)
    try:
        job_id = _submit(client, job, TaskEntry(module, argv))
    except UsageError:
        if not existed:  # leave nothing behind for a job that never was
            shutil.rmtree(folder, ignore_errors=True)
        raise
    submitted_at = time.time()
    where = " (the default for this job name and task: the same command resumes there)" if default else ""
    print(
        f"Submitted job {job_id}: {shape.nodes} node(s) x {shape.tasks_per_node} task(s)"
        f"{f' + {cfg.spare_nodes} spare node(s)' if cfg.spare_nodes else ''}, run folder "
        f"{folder}{where}",
        flush=True,
    )
    if not slurm.wait:
        print(how_to_follow(job_id, folder), flush=True)
        return exitcodes.OK
    print(
        f"Following {log_path(folder, job_id)} until the job ends (Ctrl-C stops following; the job keeps "
        "running)",
        flush=True,
    )
    from hpc_ddp.launch.slurm.follow import follow  # not imported by the tasks, which unpickle TaskEntry
    from hpc_ddp.run.checkpoint import store

    checkpoints = store.of_run(folder, cfg.checkpoint_storage)  # built once: the follower's and --min-nodes'
    try:
        return follow(
            job_id,
            checkpoints,
            shape.world_size,
            submitted_at,
            client,
            policy=policy(cfg, shape, checkpoints) if trains else None,
            resume=resume if trains else "",
        )
    except KeyboardInterrupt:
        print(
            f"\nStopped following job {job_id}; it keeps running (scancel {job_id} to stop it). To follow it "
            f"again:\n{how_to_follow(job_id, folder)}",
            flush=True,
        )
        return 130


def default_folder(launch: LaunchOptions, cfg: TrainConfig) -> Path:
    """The run folder without --folder: a training job's depends only on the command (its job name and task:
    the same command comes back to it and resumes, hpc_ddp.launch.rerun); a doctor job's is new each time."""
    assert launch.slurm is not None
    if launch.trains:
        return run_folder.default_for_submission(launch.slurm.job_name, cfg.task)
    return run_folder.default_for_submitted_check(launch.slurm.job_name)


def _client() -> SlurmClient:
    from hpc_ddp.scheduler.slurm.client import SlurmClient

    return SlurmClient()


def policy(cfg: TrainConfig, shape: JobShape, checkpoints: CheckpointStore) -> Policy:
    """The job's own rules, for `--wait` (a sweep's too: each element's) to close and act on an attempt whose batch shell died (its node
    failed): the same budgets, size and --min-nodes rule as the batch shell's `end` applies."""
    from hpc_ddp.launch import supervisor
    from hpc_ddp.launch.slurm import lost, min_nodes
    from hpc_ddp.ledger import outcomes

    return lost.Policy(
        supervisor.Budgets(cfg.max_restarts, cfg.max_requeue, outcomes.REQUEUE),
        shape.nodes + cfg.spare_nodes,  # the allocation: a requeued job asks for its spares again
        min_nodes.rule(cfg, shape.tasks_per_node, checkpoints),
        cfg.wait_for_nodes,
        shape.tasks_per_node,
        cfg.spare_nodes,
    )


def _submit(client: SlurmClient, job: slurm_submit.Submission, entry: TaskEntry) -> str:
    """Submit `job`, whose tasks run `entry`: the job id (the seam a test replaces to submit nothing)."""
    return client.submit(job, entry)
