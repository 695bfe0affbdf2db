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
   restart in place when `placement` finds one: `end` then starts the next step itself
   (hpc_ddp.scheduler.slurm.steps.run: the same srun arguments, the new nodes, HPC_DDP_IN_PLACE = its number,
   which names the attempt: hpc_ddp.cluster.env.restart_count), waits for it, and judges it in turn, until
   the job finishes, stops, or takes today's path (a requeue, when no placement is left; a preemption or a
   time limit always).

Nothing here decides whether to start again: that is the ledger's one decision (hpc_ddp.ledger.decision) and
its budgets (--max-restarts, the crash loop). `placement` only finds whether the allocation allows a restart in
place, and on which nodes: a fact the decision takes, which turns "requeue" into "restart here".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hpc_ddp.launch import spares
from hpc_ddp.ledger import decision, outcomes


@dataclass(frozen=True)
class Next:
    """The step to start next inside the allocation."""

    placement: spares.Placement
    number: int  # its HPC_DDP_IN_PLACE: restarts in place in this allocation so far, this one included


def placement(
    outcome: str,
    spare_nodes: int,
    allocation: Sequence[str],
    ran_on: Sequence[str],
    batch_host: str,
    rule: decision.Smaller,
    blamed: Sequence[str],
    signature: str = "",
    node: str | None = None,
) -> decision.InPlace | None:
    """The restart in place the allocation allows after a step on `ran_on` ended with `outcome`, or None
    (pure): only after a failure (never a preemption or a time limit: those give the allocation back) of a job
    with spares. `allocation` is the job's nodes as the controller has them now (Slurm removed the lost ones),
    `blamed` the nodes blamed in the job so far, `signature` and `node` the failure's. A rank SIGKILLed spends
    no spare (spares.to_leave): the next step runs on the same nodes, that node kept."""
    if spare_nodes <= 0 or outcome not in outcomes.FAILURES or not allocation or not ran_on:
        return None
    least = decision.least(len(ran_on), rule)
    leave = spares.to_leave(blamed, signature, node)
    kept = next((n for n in blamed if n not in leave), None)
    placed = spares.after(allocation, ran_on, leave, least, batch_host)
    if placed is None:
        return None
    return decision.InPlace(placed, len(ran_on), leave, kept, rule)
