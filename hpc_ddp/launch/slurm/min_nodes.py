"""Whether a requeued job still fits once its bad nodes are excluded, and --min-nodes: going on with fewer.

A requeue that excludes nodes must leave the job enough usable ones, or it would pend forever: it stops instead,
or, asked for with --wait-for-nodes, pends until enough come back. The decision is the ledger's
(hpc_ddp.ledger.decision: `Smaller`, `least`, `went_on` live there); this module gathers its facts for a Slurm
job (`facts`: the usable nodes left, as the scheduler's `usable` says) and reads the size a decision carries.

Without it, the batch shell's `end` step stops a job that no longer fits once its blamed nodes are excluded
(it would pend forever). With `--min-nodes M`, it requeues the job on every usable node left, as long as at
least M remain: a smaller world size, which a sharded checkpoint reshards (--allow-resize; `check_min_nodes`
in hpc_ddp.run.config refuses what cannot work, at submission and in `begin`).

Why not Slurm's own `--nodes=M-N`: Slurm pins a job's node and task counts to those of its first start (a
requeued `--nodes=1-2` job that ran on 2 nodes pends with BadConstraints once one node is left), and at
submission it may start a range job on fewer nodes than are free (`--nodes=1-2 --ntasks-per-node=1` on an
idle cluster got 1; measured on Slurm 22.05). So the job is submitted with --nodes N, and the requeue that
excludes the bad nodes also lowers NumNodes and NumTasks (hpc_ddp.scheduler.slurm.client.requeue_steps). The
batch environment still carries the task count sbatch computed at submission (SLURM_NTASKS, SLURM_NPROCS),
which srun would start on the nodes left: the batch scripts set it from the allocation first
(hpc_ddp.scheduler.slurm.request.TASK_COUNT). Tests: tests/test_launch_slurm_min_nodes.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from hpc_ddp.ledger import decision, outcomes, rules
from hpc_ddp.ledger.decision import EVERY_NODE as EVERY_NODE
from hpc_ddp.ledger.decision import Smaller as Smaller
from hpc_ddp.ledger.decision import least as least
from hpc_ddp.ledger.decision import went_on as went_on
from hpc_ddp.run.checkpoint import store
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.scheduler.base import Scheduler, Size


def rule(cfg: TrainConfig, per_node: int, checkpoints: store.CheckpointStore) -> Smaller:
    """The rule for a job of `per_node` tasks per node (0: unknown). Its --grad-accum is the one its latest
    checkpoint trains with when a resize chose it (a job that already went on with fewer nodes) and the command
    line still says what that run was asked: what the tasks will go on from (hpc_ddp.run.checkpoint.resume.resize)."""
    accum = cfg.grad_accum
    saved = _saved_accum(checkpoints)
    if saved is not None and saved[1] == cfg.grad_accum:
        accum = saved[0]
    return Smaller(cfg.min_nodes, per_node, cfg.batch_size, accum)


def _saved_accum(checkpoints: store.CheckpointStore) -> tuple[int, int] | None:
    """(--grad-accum, the command line's when it was written) of the run's latest sharded checkpoint, read
    from its manifest through the run's storage (no torch in the batch shell); None without one."""
    latest = checkpoints.latest()
    meta = store.written_with(latest, checkpoints.storage) if latest is not None else None
    try:
        accum = int(meta["config"]["grad_accum"])  # type: ignore[index]
        return accum, int(meta.get("asked_grad_accum") or accum)  # type: ignore[union-attr]
    except (KeyError, TypeError, ValueError):
        return None


def facts(
    scheduler: Scheduler,
    this_outcome: str,
    blamed: Sequence[str],
    already: Sequence[str],
    partition: str,
    needed: int,
    rule: Smaller = EVERY_NODE,
    wait: bool = False,
    spares: int = 0,
    in_place: decision.InPlace | None = None,
) -> decision.Facts:
    """The facts a Slurm job's next start is decided on: a restart `in_place` when the allocation allows one
    (hpc_ddp.launch.slurm.inplace), else the usable nodes left in `partition` once the nodes the job avoids
    `already` (its ExcNodeList) and the `blamed` ones are excluded, as the scheduler says now (`usable`: sinfo's
    states). Asked only when nodes are blamed and the attempt may be started again; `needed` is the size the
    job ran on (what it asked for), never the controller's NumNodes of the moment."""
    usable = None
    if blamed and this_outcome in outcomes.RESUMABLE and in_place is None:
        usable = len(scheduler.usable(tuple(dict.fromkeys([*already, *blamed])), partition))
    return decision.Facts(
        in_place=in_place,
        ran=needed,
        usable=usable,
        excluded=tuple(already),
        spares=spares,
        rule=rule,
        wait=wait,
        partition=partition,
    )


def size_for(decided: rules.Decision, per_node: int | None) -> Size | None:
    """The smaller size of a requeued job that goes on with fewer nodes, at `per_node` tasks each; else None."""
    if decided.nodes is None or per_node is None:
        return None
    return Size(decided.nodes, decided.nodes * per_node)
