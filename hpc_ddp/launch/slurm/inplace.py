"""Restarting inside the allocation (`--spare-nodes K`): the batch shell's steps after the first.

Why: a requeued job gives its allocation back and waits in the queue for a new one (on a busy cluster minutes
to hours; 39-107 s from a node set DOWN to the end of the job on the idle local cluster). A job that holds K
spare nodes instead starts a new `srun` step inside the allocation it already has, on the nodes that
hpc_ddp.launch.spares chooses: the failed step's healthy nodes, a spare in place of each blamed or lost one.

How, in the batch shell (both kit jobs: slurm/ddp.sbatch and the job `submit` builds):

1. `begin` chooses the first step's nodes (hpc_ddp.launch.spares.first: all but K, the batch shell's own node
   kept as a spare) and prints a shell function `srun` that the script evals: the script's own srun line
   (submitit's too) then starts the step on those nodes, and keeps its arguments for the steps after it
   (hpc_ddp.scheduler.slurm.steps).
2. `end` judges the step as always (hpc_ddp.launch.supervisor). A failure that would be requeued becomes a
   restart in place when `plan` finds a placement: `end` then starts the next step itself
   (hpc_ddp.scheduler.slurm.steps.run: the same srun arguments, the new nodes, HPC_DDP_IN_PLACE = its number,
   which names the attempt: hpc_ddp.cluster.env.restart_count), waits for it, and judges it in turn, until
   the job finishes, stops, or takes today's path (a requeue, when no placement is left; a preemption or a
   time limit always).

Nothing here decides whether to start again: that is the judge's (hpc_ddp.ledger.judge, hpc_ddp.ledger.rules) and its budgets'
(--max-restarts, the crash loop). `plan` only turns "requeue" into "restart here" when the allocation allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from hpc_ddp.launch import spares
from hpc_ddp.launch.slurm import min_nodes
from hpc_ddp.ledger import outcomes, rules


@dataclass(frozen=True)
class Next:
    """The step to start next inside the allocation."""

    placement: spares.Placement
    number: int  # its HPC_DDP_IN_PLACE: restarts in place in this allocation so far, this one included


def plan(
    decision: rules.Decision,
    outcome: str,
    spare_nodes: int,
    allocation: Sequence[str],
    ran_on: Sequence[str],
    batch_host: str,
    rule: min_nodes.Smaller,
    signature: str = "",
    node: str | None = None,
) -> tuple[rules.Decision, spares.Placement | None]:
    """A failure's requeue turned into a restart in place when the allocation allows it (pure): the decision
    to record (action RESTART, the nodes that left and the spares that came in) and the next step's nodes;
    otherwise the decision as it was and None. Only failures (never a preemption or a time limit: those give
    the allocation back) of a job with spares; `allocation` is the job's nodes as the controller has them now
    (Slurm removed the lost ones), `ran_on` the failed step's, `signature` and `node` the failure's.

    A rank SIGKILLed spends no spare (spares.to_leave): the next step runs on the same nodes."""
    if spare_nodes <= 0 or decision.action != outcomes.REQUEUE or outcome not in outcomes.FAILURES:
        return decision, None
    if not allocation or not ran_on:
        return decision, None
    least = min_nodes.least(len(ran_on), rule)
    blamed = spares.to_leave(decision.exclude, signature, node)
    kept = next((n for n in decision.exclude if n not in blamed), None)
    placement = spares.after(allocation, ran_on, blamed, least, batch_host)
    if placement is None:
        return decision, None
    nodes = ",".join(placement.nodes)
    moves = ", ".join(
        [
            *([f"{','.join(placement.left)} left"] if placement.left else []),
            *([f"spare {','.join(placement.spares_in)} in"] if placement.spares_in else []),
            f"{len(placement.spares)} spare(s) left",
        ]
    )
    message = f"{decision.message}, in place on {nodes} ({moves})"
    if placement.shrunk:
        message += "; " + min_nodes.went_on(len(ran_on), len(placement.nodes), blamed, rule)
    if kept:
        message += f" ({kept} kept: a SIGKILL is no sign of bad hardware)"
    return (
        replace(
            decision,
            action=outcomes.RESTART,
            message=message,
            left=placement.left,
            spares_in=placement.spares_in,
        ),
        placement,
    )
