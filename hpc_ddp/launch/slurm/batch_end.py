"""The batch shell's `end` step, after srun (hpc_ddp.launch.slurm.batch has the whole story): read what the step
left (`read_step`), gather the allocation's facts (`survey`), let the supervisor core judge, decide once and
record (hpc_ddp.launch.supervisor.end_attempt), and do what was decided (`act`): done, the next step in place,
a requeue, or a stop. Nothing here edits a decision: what only the batch shell knows goes in as facts.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp import exitcodes
from hpc_ddp.cluster.env import in_place, requeues, restart_count
from hpc_ddp.launch import supervisor
from hpc_ddp.launch.slurm import inplace, lost, min_nodes
from hpc_ddp.launch.slurm.batch_begin import budgets, say, taken_over, unwritable_folder
from hpc_ddp.launch.slurm.job import Job, note_start, read_state, srun_lines
from hpc_ddp.ledger import attempts as record
from hpc_ddp.ledger import decision, exits, judge, outcomes, preemption, rules
from hpc_ddp.ledger import verdict as hang_verdict
from hpc_ddp.run.checkpoint import store
from hpc_ddp.scheduler.base import End, Size
from hpc_ddp.scheduler.slurm import steps
from hpc_ddp.scheduler.slurm.client import SlurmClient
from hpc_ddp.scheduler.slurm.parse import JobInfo, hosts
from hpc_ddp.variables import IN_PLACE


def end(argv: Sequence[str], status: int, log: str, environ: Mapping[str, str], client: SlurmClient) -> int:
    """Judge the step srun ran and act; in a job with spares (--spare-nodes), a failure that would be requeued
    starts the next step here instead, inside the allocation, and that step is judged in turn
    (hpc_ddp.launch.slurm.inplace)."""
    job = Job.read(argv, environ)
    lines: Sequence[str] | None = None
    ran_on: tuple[str, ...] = ()
    try:
        while True:
            result = end_step(job, status, log, client, lines, ran_on)
            if isinstance(result, int):
                return result
            per_node = job.tasks_per_node or 1
            ran = steps.run(result.placement.nodes, result.number, job.step_args or [], per_node, job.environ)
            job, status, lines, ran_on = (
                job.stepped(ran.environ),
                ran.status,
                ran.lines,
                result.placement.nodes,
            )
    finally:
        steps.remove_step_files(job.environ)


def slurm_requeued(info: JobInfo | None, restart: int) -> bool:
    """Slurm requeued the job itself (a node failure, `scontrol requeue`, PreemptMode=REQUEUE): the job is on
    its way back to pending, or has been restarted more often than this attempt's restart count (pure)."""
    if info is None or info.gone:
        return False
    return info.state.kind.waiting or info.restarts > restart


@dataclass(frozen=True)
class Step:
    """What `end` read about a step that ended (`read_step`): the judge's evidence and what it acts on."""

    evidence: judge.Evidence | judge.Ending  # an Ending: Slurm requeued the job with every node up
    info: JobInfo | None  # the controller's view of the job
    requeued: bool  # Slurm requeued the job itself
    by_rank0: bool  # rank 0 decided about a preemption and requeued itself (--requeue-by scontrol)
    nodes: list[str]  # the step's nodes


def end_step(
    job: Job,
    status: int,
    log: str,
    client: SlurmClient,
    given: Sequence[str] | None = None,
    ran_on: Sequence[str] = (),
) -> int | inplace.Next:
    """One step's end: its record, and the exit code of the batch shell, or the next step to start in place.
    `given`: srun's lines of a step this process ran (else the batch log's, from where `begin` noted);
    `ran_on`: that step's nodes."""
    folder = job.told_folder() or job.folder
    try:  # the tasks may have ended before rank 0 made it (srun could not start them, a usage error)
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        say(f"cannot record this attempt in {folder} ({e.strerror or e}); exiting as srun did ({status})")
        return status
    taken = taken_over(folder, job.id) if status != exitcodes.OK else None
    if taken is not None:
        # Rank 0 was refused the folder (it exited 2): not this job's record to write, nor its checkpoint.
        say(taken)
        return exitcodes.USAGE
    state = read_state(folder, job.id, job.restart)
    journal = supervisor.Journal(
        store.of_run(folder, job.cfg.checkpoint_storage)
    )  # its checkpoints: built once
    this = record.find(journal.history(job.id), job.id, job.restart)
    began = float(state.get("began") or (this.started if this else 0) or 0)
    step = read_step(job, folder, status, state, this, began, log, client, given, ran_on)
    info = step.info
    rule = min_nodes.rule(job.cfg, job.tasks_per_node or 0, journal.checkpoints)

    def survey(this: record.Attempt, blamed: tuple[str, ...]) -> decision.Facts:
        # Inside the allocation first (--spare-nodes): a spare in place of the blamed node, or fewer nodes
        # (--min-nodes); else a requeue, checked against the partition's usable nodes.
        here = None
        if not step.requeued and info is not None and job.step_args is not None:
            host = info.batch_host or job.batch_host
            spare = job.cfg.spare_nodes
            here = inplace.placement(
                this.outcome, spare, info.nodes, step.nodes, host, rule, blamed, this.signature, this.node
            )
        return min_nodes.facts(
            client,
            this.outcome,
            blamed,
            info.excluded if info else (),
            info.partition if info else "",
            job.size(info),
            rule,
            job.cfg.wait_for_nodes,
            job.cfg.spare_nodes,
            in_place=here,
        )

    closed = supervisor.end_attempt(
        journal,
        job.id,
        job.restart,
        step.evidence,
        budgets(job),
        began=began,
        checkpoint=supervisor.resume_step(
            journal.checkpoints, job.id, job.environ
        ),  # memory's newest too (issue 45)
        survey=survey,
        exclude=lambda decided: decision.avoided(decided, info.excluded if info else ()),
        nodes=step.nodes,
    )
    return act(closed, journal, step, job, client, status)


def read_step(
    job: Job,
    folder: Path,
    status: int,
    state: dict[str, Any],
    this: record.Attempt | None,
    began: float,
    log: str,
    client: SlurmClient,
    given: Sequence[str] | None,
    ran_on: Sequence[str],
) -> Step:
    """What the step left and what Slurm says of it, as the judge's evidence (hpc_ddp.launch.slurm.batch)."""
    info = client.job(job.id)
    slurm_run = requeues(
        job.restart
    )  # Slurm's number of this run: a restart in place is a step of the same one
    requeued = slurm_requeued(info, slurm_run)
    nodes = (
        list(ran_on)
        or (list(this.nodes) if this else [])
        or list(state.get("nodes") or ())
        or list(hosts(job.nodelist))
    )
    lines = list(given) if given is not None else srun_lines(state, log)
    said = client.step_end(lines)  # what srun said of the step, through the scheduler's seam
    failed = status != exitcodes.OK
    gone = client.lost(job.id, nodes, said.failed_nodes, slurm_run, view=info) if failed else ()
    # Slurm requeued the job itself: accounting says whether a node failure ended this run (the node may be
    # back already: a live slurmd returns at once, ReturnToService=2), or a requeue with every node up.
    run = lost.run_of(client.history(job.id), slurm_run) if failed and requeued else None
    node_fail = bool(gone) or (run is not None and run.end is End.NODE_FAILURE)
    # This attempt's own preemption record only: an older one (kept for the user) is no decision about it.
    preempted = preemption.read_since(folder, began) if status == exitcodes.PREEMPTED else None
    by_rank0 = preempted is not None and preempted.mode == "scontrol"  # rank 0 decided and requeued itself
    usage = failed and said.first_exit == exitcodes.USAGE
    evidence = judge.Evidence(
        code=exitcodes.USAGE if usage else status,
        rank_nodes=this.ranks if this else (),
        notes=tuple(exits.read(folder, job.id, job.restart)),
        verdict=hang_verdict.read(folder, since=began) if began else None,
        killed=said.killed,
        ends=said.ends,
        requeue=preempted.requeue if preempted else None,
        rank0_requeued=(bool(preempted.requeued) if by_rank0 and preempted else None),
        lost=gone,
        node_fail=node_fail,
        refused=said.refused if failed else "",
        unwritable=unwritable_folder(folder) if failed else "",
    )
    found = judge.requeued_by_scheduler(status, requeued, node_fail) or evidence
    return Step(found, info, requeued, by_rank0, nodes)


def act(
    closed: supervisor.Closed,
    journal: supervisor.Journal,
    step: Step,
    job: Job,
    client: SlurmClient,
    status: int,
) -> int | inplace.Next:
    """Say the attempt's end and do what was decided: done, the next step in place, a requeue, or a stop."""
    folder = journal.folder
    this, decided, ending = closed.attempt, closed.decision, closed.ending
    if this.outcome == outcomes.HANG:
        say(f"{this.reason}; every rank's report: {hang_verdict.path(folder)}")
    say(closed.line + (" (Slurm requeued the job itself)" if step.requeued else ""))
    if not journal.flush():
        say(journal.lost())
    if decided.action == outcomes.DONE:
        return exitcodes.OK
    if decided.action == outcomes.RESTART and decided.on:
        number = in_place(job.restart) + 1
        following = restart_count({**job.environ, IN_PLACE: str(number)})
        note_start(folder, job.id, following, "", decided.on)
        placement = decision.Placement(decided.on, decided.left, decided.spares_in)
        return inplace.Next(placement, number)
    if decided.action == outcomes.REQUEUE:
        # Rank 0 requeued the job itself after an agreed save (--requeue-by scontrol): nothing left to do here.
        resize = min_nodes.size_for(decided, job.tasks_per_node)
        code = (
            requeue(client, job.id, this.exclude, step.info, step.requeued, resize)
            if not step.by_rank0
            else exitcodes.OK
        )
        return status if code == exitcodes.OK else code  # a requeued job's shell ends as its tasks did
    stop(job.id, ending, decided, journal.history(job.id))
    if step.requeued:
        cancel(client, job.id)
    return outcomes.exit_code(this.outcome)


def cancel(client: SlurmClient, job: str) -> None:
    """A stop decision ends the job whoever requeued it: Slurm requeued this one already (a node failure,
    `scontrol requeue`), and left alone it would run again, or pend forever when it no longer fits. Cancelled,
    not held: a held job pends forever too (only quieter), and `--wait` would follow it for good; a cancelled
    one is over, and attempts.jsonl keeps why. The cancel ends this shell: SIGTERM is blocked until then."""
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGHUP))
    done = client.cancel(job)
    say(
        f"cancelled job {job}: Slurm had requeued it, and it stops here"
        if done.ok
        else f"scancel {job} failed ({done.message}): cancel it yourself (scancel {job}), or it may run again"
    )


def requeue(
    client: SlurmClient,
    job: str,
    exclude: Sequence[str],
    info: JobInfo | None,
    already: bool,
    size: Size | None = None,
) -> int:
    """Requeue the job (unless Slurm did), excluding `exclude`, on `size` if given. The requeue ends this shell
    with SIGTERM, then SIGKILL after KillWait: SIGTERM is blocked until the job is released again."""
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGHUP))
    done = client.requeue_excluding(job, exclude, info.excluded if info else (), already, size)
    say(done.message)
    return exitcodes.OK if done.ok else exitcodes.FAILED


def stop(job: str, ending: judge.Ending, decided: rules.Decision, history: Sequence[record.Attempt]) -> None:
    """The job ends here: the first error's traceback first, once, then the attempts in one table."""
    if ending.traceback:
        say(f"the error (rank {ending.rank} on {ending.node}):")
        for line in ending.traceback.splitlines():
            print(f"    {line}", file=sys.stderr)
    say(f"job {job} stops: {decided.said}. Attempts:")
    for a in history:
        print(f"    {record.summary(a)}", file=sys.stderr)
    sys.stderr.flush()
