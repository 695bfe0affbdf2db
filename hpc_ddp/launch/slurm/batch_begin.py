"""The batch shell's `begin` step, before srun (hpc_ddp.launch.slurm.batch has the whole story).

`begin` stops the job before srun when its run folder cannot be written, or belongs to another job (held by
it, or taken over since this job's last attempt: `taken_over`); closes the open attempts of other jobs that
are over, and this job's own attempt whose batch shell died before `end` could (hpc_ddp.launch.slurm.lost,
the same judge `submit --wait` uses), applying --max-restarts to it; and notes when this attempt began (a hang
verdict or preemption record older than that is not its own) and where its srun lines start in the batch log.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpc_ddp import exitcodes
from hpc_ddp.cluster import allocator
from hpc_ddp.cluster.env import order
from hpc_ddp.errors import UsageError
from hpc_ddp.launch import spares, supervisor
from hpc_ddp.launch.slurm import lost
from hpc_ddp.launch.slurm.job import Job, note_start
from hpc_ddp.ledger import attempts as record
from hpc_ddp.ledger import decision, outcomes
from hpc_ddp.run import folder as run_folder
from hpc_ddp.run.checkpoint import store
from hpc_ddp.run.config import check_min_nodes
from hpc_ddp.scheduler.slurm import steps
from hpc_ddp.scheduler.slurm.client import SlurmClient


def say(text: str) -> None:
    print(f"[hpc_ddp] {text}", file=sys.stderr, flush=True)


def budgets(job: Job) -> decision.Budgets:
    """The job's budgets, built once from its options: a Slurm job starts again by a requeue."""
    return decision.Budgets(job.cfg.max_restarts, job.cfg.max_requeue, outcomes.REQUEUE)


def begin(argv: Sequence[str], log: str, environ: Mapping[str, str], client: SlurmClient) -> int:
    job = Job.read(argv, environ)
    cfg, folder = job.cfg, job.folder
    # Here, not only at submission: slurm/ddp.sbatch takes the options as they come. The node count is what
    # Slurm allocated (fewer than asked once the job went on without bad nodes: M is still at most that).
    first = first_step(
        cfg.spare_nodes, job.tasks_per_node, job.allocation, job.batch_host, trained_on(folder, job.id)
    )
    size = len(first.nodes) if first is not None else job.size(None)
    check_min_nodes(cfg, size, job.tasks_per_node)
    taken = taken_over(folder, job.id)
    if taken is not None:
        # Before srun: its rank 0 would be refused the folder (or, once the other job is gone, resume the
        # other job's checkpoint). Two jobs never take turns on one folder: this one stops, writing nothing.
        say(taken)
        return exitcodes.USAGE
    unwritable = unwritable_folder(folder)
    if unwritable:
        say(unwritable)
        return exitcodes.FAILED
    journal = supervisor.Journal(
        store.of_run(folder, job.cfg.checkpoint_storage)
    )  # its checkpoints: built once
    for line in lost.close_over(journal, client, lambda a: a.job != job.id):
        say(line)  # what other jobs left open here, once they are over: their budgets are theirs
    own = [a for a in journal.history(job.id) if order(a.restart) < order(job.restart) and a.ended is None]
    found = lost.ask(client, job.id) if own else None
    for open_attempt in own:
        # Its batch shell died before its `end` (its node failed, or it was killed), and the job was requeued
        # by Slurm or by a `submit --wait` that did not record it (hpc_ddp.launch.slurm.lost).
        assert found is not None
        closed = lost.close(journal, open_attempt, found, budgets(job))
        say(closed.line)
        if closed.decision.action == outcomes.STOP:
            say(f"job {job.id} stops here: {closed.decision.said}")
            return exitcodes.FAILED
    note_start(folder, job.id, job.restart, log, first.nodes if first is not None else ())
    # The script evals this: the strategy's malloc settings for every task of the job (hpc_ddp.cluster.allocator).
    print(allocator.exports(environ, cfg.strategy), end="", flush=True)
    if first is not None:
        # The script evals this: its srun starts the first step on these nodes (hpc_ddp.launch.slurm.inplace).
        print(steps.first_step(first.nodes, job.tasks_per_node or 1, job.id), end="", flush=True)
        say(
            f"--spare-nodes {cfg.spare_nodes}: the step runs on {','.join(first.nodes)}; "
            f"spare(s) {','.join(first.spares) or 'none'}"
        )
    # The number attempts.jsonl will give this attempt: its place among the folder's attempts, every job's.
    everyone = record.merge(record.read_lines(folder))
    known = record.find(everyone, job.id, job.restart)
    number = known.number if known is not None else len(everyone) + 1
    say(
        f"attempt {number} of job {job.id} (restart {job.restart}) on {job.nodelist or '?'}; run "
        f"folder {folder.absolute()}"
    )
    return exitcodes.OK


def trained_on(folder: Path, job: str) -> int | None:
    """How many nodes this job's latest attempt trained on (None before its first): a requeued job with
    spares keeps that size, whatever spares its new allocation still holds."""
    started = [a for a in record.of_job(record.read(folder), job) if a.nodes]
    return len(started[-1].nodes) if started else None


def first_step(
    spare_nodes: int,
    per_node: int | None,
    allocation: Sequence[str],
    batch_host: str,
    size: int | None = None,
) -> spares.Placement | None:
    """The first step's nodes in a job with spares (None without): every node of the `allocation` but
    --spare-nodes of them (or `size` of them: what the job trained on before a requeue), the batch shell's own
    (`batch_host`) kept as a spare. `per_node`: --ntasks-per-node, which a job with spares must have."""
    if spare_nodes <= 0:
        return None
    if per_node is None:
        raise UsageError(
            f"--spare-nodes {spare_nodes}: the job has no --ntasks-per-node, so a step on fewer nodes than "
            "the allocation could not say how many tasks to run. Fix: submit with --ntasks-per-node (one "
            "task per GPU)"
        )
    if len(allocation) <= spare_nodes:
        say(
            f"--spare-nodes {spare_nodes}: the allocation has {len(allocation)} node(s) "
            f"({','.join(allocation)}), no more than its spares: the step runs on all of them, no spare left"
        )
    held = len(allocation) - size if size is not None and 0 < size <= len(allocation) else spare_nodes
    return spares.first(allocation, held, batch_host)


def unwritable_folder(folder: Path) -> str:
    """'' when the run folder can be written (or does not exist yet: the tasks create it), else the one line
    that says it cannot and what to do. A folder that turned read-only (a file system remounted after an
    error) fails every start the same way: the job stops instead of being requeued to fail again."""
    if not folder.is_dir():
        return ""
    error = run_folder.write_test(folder, f".write-test-batch-{os.getpid()}")
    if not error:
        return ""
    return (
        f"run folder {folder} cannot be written ({error}): nothing can be saved or recorded there, and every "
        "attempt would fail the same way, so the job stops (not requeued). Fix the file system or its "
        "permissions, then run the same command again to resume from its latest checkpoint"
    )


def other_job(folder: Path, job: str) -> str | None:
    """The job that holds `folder` now when it is not this one ("" for a run without a job id); else None.
    A job never writes into, nor resumes from, another job's run folder."""
    holder = run_folder.holder_job(folder)
    return holder if holder is not None and holder != job else None


def taken_over(folder: Path, job: str) -> str | None:
    """Why this job must not use `folder` any more, or None: another job holds it now (its run.lock), or began
    an attempt in it after this job's last one (a rerun while this job waited for its requeue: it resumed this
    job's checkpoint and trains on from there). The line to say; this job then stops and writes nothing there."""
    holder = other_job(folder, job)
    if holder is not None:
        owner = f"job {holder}" if holder else "another run"
        return (
            f"run folder {folder} is held by {owner}: this job recorded nothing there and stops (a usage "
            "error, not retried). Fix: give this job its own --folder"
        )
    newer = after_this_job(record.merge(record.read_lines(folder)), job)
    if newer is None:
        return None
    return (
        f"run folder {folder} was taken over by job {newer} since this job's last attempt (the same command, "
        "run again while this job waited to start again): two jobs never take turns on one folder, so this job "
        f"stops here and records nothing; job {newer}'s run is the one that goes on"
    )


def after_this_job(history: Sequence[record.Attempt], job: str) -> str | None:
    """The other job that began an attempt after this job's last one began, if any (pure)."""
    mine = [a.started or 0 for a in history if a.job == job]
    if not mine:
        return None  # a new job in a folder others used before: it continues their run
    since = max(mine)
    later = [a for a in history if a.job != job and (a.started or 0) > since]
    return later[0].job if later else None
