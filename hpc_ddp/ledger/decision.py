"""The one decision: what a job does after an attempt ended, from the ledger's rules and the allocation's facts.

Every actor that decides about an attempt calls `decide` here and acts on what it returns, unchanged: rank 0
deciding alone after a preemption (hpc_ddp.run.loop.preemption), the local launcher, the batch shell's `end` and
`begin` (hpc_ddp.launch.slurm.batch) and the `--wait` follower (hpc_ddp.launch.slurm.follow). What differs between
them is only what they know, and that is an input: the budgets (`Budgets`, built once from the options) and the
allocation's facts (`Facts`: whether the job is over, a stop the supervisor was asked for, the nodes a restart in
place would run on, how many usable nodes are left once the blamed ones are excluded, --min-nodes,
--wait-for-nodes). The supervisor gathers the facts (it asks its scheduler) and never edits the decision after.

    rules.decide     the budgets: done, start again, or stop (--max-restarts, --max-requeue, the crash loop)
    on_allocation    what the allocation makes of a start again: a restart in place on these nodes, a requeue
                     on fewer nodes (--min-nodes), one that waits for nodes, or a stop (it would pend forever)

The returned `Decision` is data (its action, the nodes, its message and the advice apart): nobody reads its
message to learn what was decided. Pure: no clock, no file, no scheduler (tests/test_ledger_decision.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from hpc_ddp.ledger import outcomes as record
from hpc_ddp.ledger import rules
from hpc_ddp.ledger.attempts import Attempt
from hpc_ddp.ledger.rules import Decision


@dataclass(frozen=True)
class Budgets:
    """A job's two budgets and how it starts again, built once from its options by its supervisor."""

    max_restarts: int  # failures after which the job is not started again (--max-restarts)
    max_requeue: int  # preemptions after which it is not started again (--max-requeue)
    again: str  # how it starts again here: outcomes.RESTART (the local launcher), REQUEUE (Slurm)


NO_BUDGETS = Budgets(0, 0, record.REQUEUE)  # a job that is over: nothing is started again


@dataclass(frozen=True)
class Placement:
    """A step's nodes inside an allocation, and how they differ from the step before
    (chosen by hpc_ddp.launch.spares)."""

    nodes: tuple[str, ...]  # the step's nodes, in the allocation's order
    left: tuple[str, ...] = ()  # nodes of the step before that this one leaves out (blamed or lost)
    spares_in: tuple[str, ...] = ()  # nodes this step takes that the step before did not use (spares)
    spares: tuple[str, ...] = ()  # the allocation's nodes still unused: spares for a later step

    @property
    def shrunk(self) -> bool:
        """Fewer nodes than the step before: what left was not replaced."""
        return len(self.left) > len(self.spares_in)


@dataclass(frozen=True)
class Smaller:
    """What lets a job go on with fewer nodes (--min-nodes): the least it may run on, and what to tell about it."""

    least: int = 0  # --min-nodes, or 0: every node it ran on
    per_node: int = 0  # tasks per node (0: unknown, and `begin` refused --min-nodes below the job's nodes)
    batch: int = 0  # samples per rank per micro-step
    grad_accum: int = 1


EVERY_NODE = Smaller()  # no --min-nodes: the job needs every node it ran on


@dataclass(frozen=True)
class InPlace:
    """A restart in place the allocation allows (--spare-nodes): the next step's nodes, and what to say."""

    placement: Placement
    ran: int  # the nodes the failed step ran on
    leave: tuple[str, ...]  # the blamed nodes the next step leaves out (hpc_ddp.launch.spares.to_leave)
    kept: str | None = None  # a blamed node it keeps (a rank SIGKILLed there: no sign of bad hardware)
    rule: Smaller = EVERY_NODE  # --min-nodes: how it may go on with fewer


@dataclass(frozen=True)
class Facts:
    """What the supervisor knows of the job and its allocation as the attempt ends: the decision's inputs.
    The defaults are a supervisor that knows nothing of nodes (the decision is the budgets' alone)."""

    over: bool = False  # the whole job is over (no run to come): whatever ended, it stops
    ended: bool = False  # this run is over and the job does not pend: only a lost node brings it back
    stop: str | None = None  # a stop the launcher was asked for (Ctrl-C, a signal): its words
    in_place: InPlace | None = None  # a restart in place is possible, on these nodes (--spare-nodes)
    ran: int = 0  # the nodes the job asked for (what it ran on): what a requeue needs
    usable: int | None = None  # nodes left: the partition's usable ones once `excluded` are (None: not asked)
    excluded: tuple[str, ...] = ()  # the nodes the job avoids already (its ExcNodeList): a requeue keeps them
    spares: int = 0  # --spare-nodes: of `ran`, the nodes a requeued job may go on without
    rule: Smaller = EVERY_NODE  # --min-nodes
    wait: bool = False  # --wait-for-nodes
    partition: str = ""


def decide(
    history: Sequence[Attempt],
    this: Attempt,
    budgets: Budgets,
    facts: Facts = Facts(),
    *,
    retryable: bool = True,
    decided: bool = False,
) -> Decision:
    """What the job does after `this` attempt ended (`history`: the job's attempts before it, in order):
    the budgets' word (rules.decide), then what the allocation's `facts` make of it (`on_allocation`).
    `retryable` is False when the kit itself stopped the run (Ending.retryable); `decided`: rank 0 decided about
    this preemption itself (Ending.decided), so no budget is applied to it here. Pure."""
    base = rules.decide(
        history,
        this,
        budgets.max_restarts,
        budgets.again,
        retryable,
        max_requeue=None if decided else budgets.max_requeue,
    )
    return on_allocation(base, this, facts)


def on_allocation(base: Decision, this: Attempt, facts: Facts) -> Decision:
    """The budgets' decision `base` about `this` attempt, made whole with the allocation's `facts` (pure)."""
    if facts.over:
        return Decision(record.STOP, "the job is over", base.exclude)
    if base.action == record.RESTART and facts.stop is not None:
        return Decision(record.STOP, f"not restarted: {facts.stop}", base.exclude)
    again = base.action in (record.REQUEUE, record.RESTART)
    if again and facts.in_place is not None and this.outcome in record.FAILURES:
        return _in_place(base, facts.in_place)
    if base.action != record.REQUEUE:
        return base
    if facts.ended and this.outcome != record.NODE_FAIL:
        # Over, and no node failed under it: its batch shell ended some other way (killed, or its own record
        # could not be written). Only a lost node is a reason to bring a job that ended back.
        return Decision(record.STOP, "the job is over and no node of it failed: not requeued", base.exclude)
    return _fit(base, facts)


def avoided(decision: Decision, already: Sequence[str]) -> tuple[str, ...]:
    """The nodes a requeued job must avoid: those it avoids `already` (its ExcNodeList), and every node blamed
    so far (pure)."""
    if decision.action != record.REQUEUE or not decision.exclude:
        return decision.exclude
    return tuple(dict.fromkeys([*already, *decision.exclude]))


def _in_place(base: Decision, found: InPlace) -> Decision:
    """A start again turned into a restart in place on the nodes `found` (--spare-nodes)."""
    placement = found.placement
    moves = ", ".join(
        [
            *([f"{','.join(placement.left)} left"] if placement.left else []),
            *([f"spare {','.join(placement.spares_in)} in"] if placement.spares_in else []),
            f"{len(placement.spares)} spare(s) left",
        ]
    )
    message = f"{base.message}, in place on {','.join(placement.nodes)} ({moves})"
    if placement.shrunk:
        message += "; " + went_on(found.ran, len(placement.nodes), found.leave, found.rule)
    if found.kept:
        message += f" ({found.kept} kept: a SIGKILL is no sign of bad hardware)"
    return replace(
        base,
        action=record.RESTART,
        message=message,
        on=placement.nodes,
        left=placement.left,
        spares_in=placement.spares_in,
    )


def _fit(base: Decision, facts: Facts) -> Decision:
    """A requeue that excludes nodes, against the usable nodes left (`facts.usable`; `facts.ran`, the size the
    job ran on, never the controller's NumNodes of the moment). Enough: it stands. Fewer, but not fewer than
    the training nodes of a job with spares: it goes on with fewer idle spares. Fewer still but at least
    --min-nodes: it goes on with every usable node left (`Decision.nodes`). Fewer still: it stops (it would
    pend forever), unless --wait-for-nodes asks it to pend until enough come back."""
    exclude = avoided(base, facts.excluded)
    if not exclude or facts.usable is None:
        return base
    usable, needed, spares = facts.usable, facts.ran, facts.spares
    if usable >= needed:
        return base
    if spares and usable >= needed - spares:
        return replace(
            base,
            message=f"{base.message}; it goes on with {usable - (needed - spares)} of its "
            f"--spare-nodes {spares} (the usable nodes left once {','.join(exclude)} are excluded)",
            nodes=usable,
        )
    fewest = least(needed, facts.rule)
    if usable >= fewest:
        return replace(
            base, message=f"{base.message}; {went_on(needed, usable, exclude, facts.rule)}", nodes=usable
        )
    minimum = f" (at least {fewest}, --min-nodes)" if fewest < needed else ""
    short = (
        f"the job needs {needed} node(s){minimum} and only {usable} usable one(s) remain in partition "
        f"{facts.partition or '?'} once {','.join(exclude)} are excluded (the others are down, drained or "
        "excluded)"
    )
    if facts.wait:  # asked for: it pends until enough nodes come back (`submit --wait` says so every minute)
        return replace(base, message=f"{base.message}; {short}: it waits for nodes (--wait-for-nodes)")
    return Decision(record.STOP, f"cannot requeue: {short}", exclude)


def least(needed: int, rule: Smaller) -> int:
    """The fewest nodes the job may go on with, having run on `needed` (pure)."""
    return rule.least if 0 < rule.least < needed and rule.per_node else needed


def kept_accum(grad_accum: int, saved: int, now: int) -> int | None:
    """The --grad-accum that keeps the global batch of `grad_accum` micro-batches on `saved` ranks once on `now`
    ranks, or None (hpc_ddp.run.config.accum_for's arithmetic, which the resize applies: the ledger is below
    the run layer, and tests/test_ledger_decision.py holds the two to the same answers)."""
    return grad_accum * saved // now if (grad_accum * saved) % now == 0 else None


def went_on(ran: int, left: int, exclude: Sequence[str], rule: Smaller) -> str:
    """What going on with fewer nodes changes, as the attempt line says it: the nodes, the ranks, and the
    global batch, or the --grad-accum that keeps it (hpc_ddp.run.checkpoint.resume.resize does the same arithmetic)."""
    before, after = ran * rule.per_node, left * rule.per_node
    kept = kept_accum(rule.grad_accum, before, after)
    total = rule.batch * rule.grad_accum * before
    batch = (
        f"the global batch stays {total} (--grad-accum {kept})"
        if kept is not None
        else f"the global batch goes from {total} to {rule.batch * rule.grad_accum * after} (no --grad-accum "
        "keeps it)"
    )
    return (
        f"--min-nodes {rule.least}: it goes on with the {left} usable node(s) left of the {ran} it ran on "
        f"({','.join(exclude)} excluded), {after} rank(s) instead of {before}, its sharded checkpoint "
        f"resharded (--allow-resize); {batch}"
    )
