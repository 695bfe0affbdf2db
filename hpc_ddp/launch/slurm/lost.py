"""Which nodes an attempt lost, and the attempts whose batch shell died before its `end` step.

The kit's jobs run with `--no-kill` (hpc_ddp.scheduler.slurm.request): when a node fails, Slurm keeps the job and
removes that node from it; the step's tasks are killed ("srun: error: Node failure on node2") and the batch
shell, on the job's first node, decides (hpc_ddp.launch.slurm.batch.end). Measured on Slurm 22.05: the job's
NodeList then lacks the failed node (`squeue -o %N`), accounting shows a RESIZING record and no NODE_FAIL; a
node Slurm set DOWN that returns at once (a live slurmd, ReturnToService=2) is idle again before anyone looks,
and only srun's line and the job's NodeList still tell; a node an administrator drains is "drng" (draining)
while the job runs and "drain" after, exactly as a node set DOWN then DRAIN: node states alone cannot tell a
failure from a drain, so a drained node is never blamed on its state.

When the failed node is the batch shell's own, nothing of the job is left to decide: Slurm ends it FAILED
(Reason JobLaunchFailure, the batch script killed by signal 9), and never requeues it, `--requeue` or not. Its
attempt stays open until one of the kit's processes finds it, and `close` is the one judge of such an attempt,
whoever comes first (the record then says the same):

- `submit --wait` (hpc_ddp.launch.slurm.follow) once Slurm says the job's run is over: with the job's own
  budgets, it requeues the job (a finished job can be requeued while the controller remembers it) away from
  the lost node, goes on with fewer nodes (--min-nodes), or stops it;
- the job's own next attempt (`begin`), after a requeue nobody recorded (Slurm's own: `scontrol requeue`, or a
  job submitted without --no-kill);
- the next job's `begin` in the same folder (the same command run again), once that job is over: with no
  budgets, since the job is over.

An attempt a time limit or a cancel ended before its batch shell could record it is closed the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from hpc_ddp.cluster.env import requeues
from hpc_ddp.launch import supervisor
from hpc_ddp.launch.slurm import min_nodes
from hpc_ddp.ledger import attempts as record
from hpc_ddp.ledger import decision, judge, outcomes
from hpc_ddp.scheduler.base import Kind
from hpc_ddp.scheduler.slurm.client import SlurmClient
from hpc_ddp.scheduler.slurm.lost import lost_nodes as lost_nodes
from hpc_ddp.scheduler.slurm.lost import removed as removed
from hpc_ddp.scheduler.slurm.parse import JobHistory, JobInfo
from hpc_ddp.scheduler.slurm.states import JobState

# ----- pure parts ----------------------------------------------------------------------------------------


def run_of(history: JobHistory | None, restart: int) -> JobState | None:
    """Accounting's record of the job's run number `restart` (one record per start; a resize writes none of
    its own here: hpc_ddp.scheduler.slurm.parse), else its latest (pure)."""
    if history is None or not history.runs:
        return None
    return history.runs[restart] if restart < len(history.runs) else history.current


def ending(attempt: record.Attempt, run: JobState | None, lost: Sequence[str]) -> judge.Ending:
    """How an attempt whose batch shell died ended, as the judge reads accounting's record of its run `run`
    (hpc_ddp.ledger.judge.unrecorded; pure)."""
    over = run is not None and run.done
    return judge.unrecorded(
        attempt.ranks, run.end if over and run else None, run.state if over and run else "", lost
    )


# ----- closing them ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Found:
    """What Slurm says about one job, asked once for all its open attempts."""

    info: JobInfo | None
    history: JobHistory | None
    states: Mapping[str, str]


def ask(client: SlurmClient, job: str) -> Found:
    return Found(client.job(job), client.history(job), client.nodes())


def over(attempt: record.Attempt, found: Found) -> bool:
    """The attempt's run is over, so its batch shell cannot record it any more: the controller says the job
    ended, or it has been requeued since that run (pending, held or running again), or it forgot the job while
    accounting says that run ended (pure)."""
    info = found.info
    if info is not None and not info.gone:
        return info.state.done or info.restarts > requeues(attempt.restart)
    run = run_of(found.history, requeues(attempt.restart))
    return info is not None and run is not None and run.done


def close(
    journal: supervisor.Journal,
    attempt: record.Attempt,
    found: Found,
    budgets: decision.Budgets,
    survey: supervisor.Survey | None = None,
) -> supervisor.Closed:
    """Judge and record an attempt whose batch shell died (`over` said so): the one judge of such an attempt,
    whoever calls it. `budgets` are the job's own (--max-restarts, --max-requeue) when the caller may act on
    the decision, else none (the job is over: every ending is a stop); `survey` gives the decision what only
    the caller knows (the job is over; the usable nodes left)."""
    # Slurm numbers runs by requeue; a restart in place (hpc_ddp.launch.slurm.inplace) is a step of one.
    # The rule behind SlurmClient.lost, on what was asked once for all the job's open attempts (`ask`).
    lost = lost_nodes(attempt.nodes, (), found.info, found.states, requeues(attempt.restart))
    run = run_of(found.history, requeues(attempt.restart))
    when = attempt.started or 0
    return supervisor.end_attempt(
        journal,
        attempt.job,
        attempt.restart,
        ending(attempt, run, lost),
        budgets,
        began=when,
        checkpoint=supervisor.latest_step(journal.checkpoints),
        now=_ended_at(journal, when),
        survey=survey,
    )


def _ended_at(journal: supervisor.Journal, began: float) -> float | None:
    """When the attempt's processes ended: its last progress record, not now. An attempt closed after the fact
    (by a follower or the next job, maybe hours later) did not hold its nodes all that while."""
    from hpc_ddp.run.records.reached import last_seen

    return last_seen(journal.folder, began) if began else None


@dataclass(frozen=True)
class Policy:
    """A job's own rules for going on, for a closer that may act on its decision (`submit --wait`)."""

    budgets: decision.Budgets  # --max-restarts, --max-requeue
    size: int  # the nodes the job asked for
    rule: min_nodes.Smaller = min_nodes.EVERY_NODE  # --min-nodes
    wait: bool = False  # --wait-for-nodes
    tasks_per_node: int = 0
    spares: int = 0  # --spare-nodes: of `size`, the nodes a requeued job may go on without


@dataclass(frozen=True)
class Settled:
    closed: supervisor.Closed
    said: tuple[str, ...]  # what was done about the job, one line each


def settle(
    journal: supervisor.Journal, client: SlurmClient, attempt: record.Attempt, found: Found, policy: Policy
) -> Settled:
    """Close an attempt whose batch shell died (`close`), with the job's own budgets, and act as its batch
    shell would have: requeue the job (a finished one too: Slurm requeues it while its controller remembers
    it) away from the nodes blamed so far, on fewer nodes with --min-nodes; or stop it: a job Slurm requeued
    itself would pend, maybe forever on nodes that are gone, so it is cancelled (attempts.jsonl keeps why)."""
    info = found.info
    already = info.excluded if info is not None else ()
    partition = info.partition if info is not None else ""
    pending = info is not None and not info.gone and info.state.kind.waiting

    def survey(this: record.Attempt, blamed: tuple[str, ...]) -> decision.Facts:
        # Over and not pending: only a lost node brings it back (`ended`); then, the usable nodes left.
        ask = pending or this.outcome == outcomes.NODE_FAIL  # else sinfo has nothing to say about it
        facts = min_nodes.facts(
            client,
            this.outcome,
            blamed if ask else (),
            already,
            partition,
            policy.size,
            policy.rule,
            policy.wait,
            policy.spares,
        )
        return replace(facts, ended=not pending)

    closed = close(journal, attempt, found, policy.budgets, survey)
    job, decided = attempt.job, closed.decision
    if decided.action == outcomes.REQUEUE and not pending and not closed.recorded:
        # A decision that is not in attempts.jsonl would be taken again at the next look, and again: the
        # budgets count records. Acting on it needs the record.
        return Settled(
            closed,
            (
                f"not requeued: the decision could not be recorded in {journal.folder} ({journal.error}); "
                "once the folder can be written, run the same command to resume",
            ),
        )
    if decided.action == outcomes.REQUEUE:
        size = min_nodes.size_for(decided, policy.tasks_per_node or None)
        exclude = decision.avoided(decided, already)
        done = client.requeue_excluding(job, exclude, already, pending, size)
        return Settled(closed, (done.message,))
    if decided.action == outcomes.STOP and pending:
        done = client.cancel(job)
        said = (
            f"cancelled job {job}: Slurm had requeued it, and it stops here"
            if done.ok
            else f"scancel {job} failed ({done.message}): cancel it yourself (scancel {job}), or it may run again"
        )
        return Settled(closed, (said,))
    return Settled(closed, ())


def settle_open(
    journal: supervisor.Journal, client: SlurmClient, job: str, policy: Policy | None
) -> tuple[list[Settled], str]:
    """Every open attempt of `job` in the journal's folder whose run is over (its batch shell died: its node
    was lost), closed: with the job's `policy`, acted on as its batch shell would have (`settle`); without
    one, only once the whole job is over, as a stop. What was settled, in order, and the line that says the
    journal could not be written ("" when it was). Asks Slurm nothing where the folder has no open attempt of
    the job: the usual end costs no call. A single job's --wait and a sweep's (each element) call it."""
    left = [a for a in record.of_job(record.read(journal.folder), job) if a.ended is None]
    if not left:
        return [], ""
    found = ask(client, job)
    done: list[Settled] = []
    for attempt in [a for a in left if over(a, found)]:
        if policy is not None:
            done.append(settle(journal, client, attempt, found, policy))
        elif job_over(found):
            done.append(Settled(close(journal, attempt, found, no_budgets(), the_job_is_over), ()))
    return done, ("" if journal.flush() else journal.lost())


def no_budgets() -> decision.Budgets:
    return decision.NO_BUDGETS


def the_job_is_over(_this: record.Attempt, _blamed: tuple[str, ...]) -> decision.Facts:
    """The facts of a job that is over: whatever ended its attempt, nothing starts again."""
    return decision.Facts(over=True)


def close_over(
    journal: supervisor.Journal, client: SlurmClient, which: Callable[[record.Attempt], bool]
) -> list[str]:
    """Close the open attempts of the folder that `which` selects once Slurm says their jobs are over, each as a
    stop (nothing to decide: the job is over); the lines that say so. A job still running, or one Slurm does
    not answer for, is left alone. The next job's `begin` calls it for the other jobs of its folder."""
    left = [a for a in record.merge(record.read_lines(journal.folder)) if which(a) and a.ended is None]
    lines = []
    for job in sorted({a.job for a in left}):
        found = ask(client, job)
        for attempt in [a for a in left if a.job == job]:
            if found.info is None or (found.info.gone and found.history is None) or not job_over(found):
                continue
            closed = close(journal, attempt, found, no_budgets(), the_job_is_over)
            lines.append(f"job {job}: {closed.line}")
    return lines


def job_over(found: Found) -> bool:
    """The whole job is over (no run to come): the controller says so, or forgot it while accounting's last
    record ended a run (pure)."""
    info = found.info
    if info is not None and not info.gone:
        return info.state.done
    return (
        found.history is not None
        and found.history.current.done
        and found.history.current.kind is not Kind.REQUEUED
    )
