"""The budgets' word on an attempt that ended, pure: done, start again, or stop; and its two budgets, each one rule.
The whole decision, with the allocation's facts, is hpc_ddp.ledger.decision.decide: every actor calls that one.

`decide(history, this, ...)` reads the attempt as it ended (hpc_ddp.ledger.judge) and the job's attempts
before it:

- finished: done. A usage error or a non-finite loss: stop (the same input fails the same way again).
- a preemption the ranks saved for (preempted.json): start again while the job's preemptions stay within
  --max-requeue (`requeue_budget`); a stop signal (SIGTERM) among them: stop. Where rank 0 decided alone
  (--requeue-by scontrol) its decision stands and no budget is applied here (rank 0 applies the same rule:
  hpc_ddp.run.loop.preemption.decide).
- a failure (a rank raising, a peer vanishing, a hang verdict, a node failure): start again from the latest
  checkpoint while the job's failures stay within --max-restarts, except a *crash loop*: an attempt that fails
  with the same signature as the attempt before it, without a newer checkpoint in between, is an error in the
  code or data, not bad luck, and the job stops.
- every node blamed so far is excluded from the next start (on Slurm: the requeued job's ExcNodeList; locally
  the blame is only recorded).

How the job starts again is the supervisor's word (`again`): outcomes.REQUEUE on Slurm, RESTART where the
supervisor starts the ranks itself (the local launcher; a restart inside an allocation is one too). What
counts against each budget is `preemptions` and `failures`, and nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hpc_ddp.ledger import outcomes as record
from hpc_ddp.ledger.attempts import Attempt

RESUME_ADVICE = "Resume with the same command and --folder"


@dataclass(frozen=True)
class Decision:
    action: str  # outcomes.DONE, RESTART (local, or in place on Slurm) / REQUEUE (Slurm), or STOP
    message: str  # why, in words: for people only (nobody reads it to learn what was decided)
    exclude: tuple[str, ...] = field(default_factory=tuple)  # every node blamed in this job so far
    crash_loop: bool = False
    nodes: int | None = None  # the nodes a requeued job goes on with, fewer than it ran on (--min-nodes)
    left: tuple[str, ...] = ()  # a restart in place (--spare-nodes): the nodes the next step leaves out
    spares_in: tuple[str, ...] = ()  # ... and the spares it takes in their place
    on: tuple[str, ...] = ()  # a restart in place: the nodes the next step runs on
    advice: str = ""  # what the user may do about a stop (RESUME_ADVICE), apart from why

    @property
    def said(self) -> str:
        """The message and its advice, as a supervisor's line says them."""
        return f"{self.message}. {self.advice}" if self.advice else self.message


def preemptions(history: Sequence[Attempt]) -> int:
    """The preemptions of `history` (one job's attempts): what --max-requeue counts."""
    return sum(1 for a in history if a.outcome == record.PREEMPTED)


def failures(history: Sequence[Attempt]) -> int:
    """The failures of `history` (one job's attempts): what --max-restarts counts (outcomes.FAILURES)."""
    return sum(1 for a in history if a.failed)


@dataclass(frozen=True)
class Budget:
    """Whether one more start fits in --max-requeue after `done` preemptions, and the words for it."""

    ok: bool
    message: str
    advice: str = ""  # what the user may do once it is spent

    @property
    def said(self) -> str:
        return f"{self.message}. {self.advice}" if self.advice else self.message


def requeue_budget(done: int, max_requeue: int) -> Budget:
    """--max-requeue after `done` earlier preemptions of the job: one more start, or the budget is spent. The
    one rule every decider applies: the supervisors (`decide`) and rank 0 deciding alone."""
    if done >= max_requeue:
        return Budget(
            False,
            f"requeue budget spent ({done} of --max-requeue {max_requeue}), not requeued",
            RESUME_ADVICE,
        )
    return Budget(True, f"requeue {done + 1} of --max-requeue {max_requeue}")


def blamed_nodes(history: Sequence[Attempt]) -> tuple[str, ...]:
    """Every node blamed in `history`, first first: the failing rank's node, and each node lost with it."""
    nodes: list[str] = []
    for a in history:
        for node in (a.node, *a.lost) if a.blamed else ():
            if node and node not in nodes:
                nodes.append(node)
    return tuple(nodes)


def decide(
    history: Sequence[Attempt],
    this: Attempt,
    max_restarts: int,
    again: str = record.REQUEUE,
    retryable: bool = True,
    *,
    max_requeue: int | None = None,
) -> Decision:
    """What the job does after `this` attempt ended. `history` is this job's attempts before it, in order;
    `again` is how it starts again here (outcomes.REQUEUE on Slurm, RESTART locally); `retryable` is False
    when the kit itself stopped the run (Ending.retryable). The two budgets: `max_restarts` counts failures,
    `max_requeue` preemptions (None: rank 0 decided about this preemption itself, Ending.decided). Pure."""
    exclude = blamed_nodes([*history, this])
    if this.outcome == record.COMPLETED:
        return Decision(record.DONE, "finished", exclude)
    if this.outcome == record.PREEMPTED:
        if max_requeue is None:
            return Decision(again, "resuming from the checkpoint it saved", exclude)
        budget = requeue_budget(preemptions(history), max_requeue)
        if not budget.ok:
            return Decision(record.STOP, budget.message, exclude, advice=budget.advice)
        return Decision(again, f"{budget.message}, resuming from the latest checkpoint", exclude)
    if this.outcome == record.STOPPED:
        return Decision(record.STOP, "stopped after saving a checkpoint (not requeued)", exclude)
    if this.outcome in (record.USAGE, record.NONFINITE):
        return Decision(record.STOP, "not retried: the same input fails the same way again", exclude)
    if not retryable:
        return Decision(record.STOP, "not retried: the run stopped itself (see its one-line error)", exclude)
    return _after_failure(history, this, max_restarts, again, exclude)


def _after_failure(
    history: Sequence[Attempt], this: Attempt, max_restarts: int, again: str, exclude: tuple[str, ...]
) -> Decision:
    """A failure: a crash loop stops the job, as does a spent --max-restarts; else it starts again."""
    count = failures(history) + 1
    before = history[-1] if history else None
    if before is not None and crash_loop(before, this):
        return Decision(
            record.STOP,
            f"crash loop: attempt {this.number} failed with the same error as attempt "
            f"{before.number} and no newer checkpoint in between; not retried "
            "(an error in the code or data, not bad luck)",
            exclude,
            crash_loop=True,
        )
    if count > max_restarts:
        return Decision(
            record.STOP, f"restart budget spent: {count} failure(s), --max-restarts {max_restarts}", exclude
        )
    since = (
        f"the checkpoint at step {this.checkpoint}"
        if this.checkpoint is not None
        else "the start (no checkpoint yet)"
    )
    return Decision(
        again, f"restarting from {since} (failure {count} of --max-restarts {max_restarts})", exclude
    )


def crash_loop(before: Attempt, this: Attempt) -> bool:
    """`this` failed with the same error as the attempt `before` it, with no newer checkpoint in between, and
    not on another node both blamed (a bad node's error follows no job): the code's or the data's (pure)."""
    elsewhere = before.blamed and this.blamed and before.node != this.node
    newer = (this.checkpoint if this.checkpoint is not None else -1) > (
        before.checkpoint if before.checkpoint is not None else -1
    )
    return before.failed and before.signature == this.signature and not elsewhere and not newer
