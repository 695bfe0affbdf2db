"""Whether a requeued job still fits once its bad nodes are excluded, and --min-nodes: going on with fewer.

A requeue that excludes nodes must leave the job enough usable ones, or it would pend forever (`fit`): it
stops instead, or, asked for with --wait-for-nodes, pends until enough come back.

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
(hpc_ddp.scheduler.slurm.request.TASK_COUNT). Everything here is pure (tests/test_launch_slurm_min_nodes.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from hpc_ddp.ledger import outcomes, rules
from hpc_ddp.run.checkpoint import store
from hpc_ddp.run.config import TrainConfig, accum_for
from hpc_ddp.scheduler.base import Size
from hpc_ddp.scheduler.slurm import env as slurm_env
from hpc_ddp.scheduler.slurm.states import usable as usable_nodes


@dataclass(frozen=True)
class Smaller:
    """What lets a job go on with fewer nodes: the least it may run on, and what to tell about it."""

    least: int = 0  # --min-nodes, or 0: every node it ran on
    per_node: int = 0  # tasks per node (0: unknown, and `begin` refused --min-nodes below the job's nodes)
    batch: int = 0  # samples per rank per micro-step
    grad_accum: int = 1


EVERY_NODE = Smaller()  # no --min-nodes: the job needs every node it ran on


def smaller(cfg: TrainConfig, environ: Mapping[str, str], checkpoints: store.CheckpointStore) -> Smaller:
    """The rule for this job, in its batch shell (its --ntasks-per-node from the environment)."""
    return rule(cfg, slurm_env.tasks_per_node(environ) or 0, checkpoints)


def rule(cfg: TrainConfig, per_node: int, checkpoints: store.CheckpointStore) -> Smaller:
    """The rule for a job of `per_node` tasks per node (0: unknown). Its --grad-accum is the one its latest
    checkpoint trains with when a resize chose it (a job that already went on with fewer nodes) and the command
    line still says what that run was asked: what the tasks will go on from (hpc_ddp.run.resume.resize)."""
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


def excluded(decision: rules.Decision, already: Sequence[str]) -> tuple[str, ...]:
    """The nodes a requeued job must avoid: those it avoids `already` (its ExcNodeList), and every node blamed
    so far (pure)."""
    if decision.action != outcomes.REQUEUE or not decision.exclude:
        return decision.exclude
    return tuple(dict.fromkeys([*already, *decision.exclude]))


def fit(
    decision: rules.Decision,
    states: Mapping[str, str],
    already: Sequence[str],
    partition: str,
    needed: int,
    rule: Smaller = EVERY_NODE,
    wait: bool = False,
    spares: int = 0,
) -> rules.Decision:
    """A requeue that excludes nodes, checked against the partition's nodes (`states`: sinfo's) (pure).
    `needed` is the size the job ran on (what it asked for), never the controller's NumNodes of the moment.
    Enough usable nodes left: the decision stands. Fewer, but at least --min-nodes: it goes on with every
    usable node left (`Decision.nodes`). Fewer still: it stops (it would pend forever), unless `wait`
    (--wait-for-nodes) asks it to pend until enough come back."""
    exclude = excluded(decision, already)
    if decision.action != outcomes.REQUEUE or not exclude:
        return decision
    usable = usable_nodes(states, exclude)
    if len(usable) >= needed:
        return decision
    if spares and len(usable) >= needed - spares:
        # --spare-nodes: the job trains on `needed - spares`; it goes on with fewer idle spares, same world size.
        return replace(
            decision,
            message=f"{decision.message}; it goes on with {len(usable) - (needed - spares)} of its "
            f"--spare-nodes {spares} (the usable nodes left once {','.join(exclude)} are excluded)",
            nodes=len(usable),
        )
    fewest = least(needed, rule)
    if len(usable) >= fewest:
        return go_on(decision, needed, len(usable), exclude, rule)
    minimum = f" (at least {fewest}, --min-nodes)" if fewest < needed else ""
    short = (
        f"the job needs {needed} node(s){minimum} and only {len(usable)} usable one(s) remain in partition "
        f"{partition or '?'} once {','.join(exclude)} are excluded (the others are down, drained or excluded)"
    )
    if wait:  # asked for: it pends until enough nodes come back (`submit --wait` says so every minute)
        return replace(
            decision, message=f"{decision.message}; {short}: it waits for nodes (--wait-for-nodes)"
        )
    return rules.Decision(outcomes.STOP, f"cannot requeue: {short}", exclude)


def least(needed: int, rule: Smaller) -> int:
    """The fewest nodes the job may go on with, having run on `needed`."""
    return rule.least if 0 < rule.least < needed and rule.per_node else needed


def go_on(
    decision: rules.Decision, ran: int, usable: int, exclude: Sequence[str], rule: Smaller
) -> rules.Decision:
    """A requeue on the `usable` nodes left, fewer than the `ran` it ran on, that --min-nodes allows (the
    caller checked `usable >= least(ran, rule)`): the decision says so and carries the count."""
    return replace(
        decision, message=f"{decision.message}; {went_on(ran, usable, exclude, rule)}", nodes=usable
    )


def went_on(ran: int, left: int, exclude: Sequence[str], rule: Smaller) -> str:
    """What going on with fewer nodes changes, as the attempt line says it: the nodes, the ranks, and the
    global batch, or the --grad-accum that keeps it (hpc_ddp.run.resume.resize does the same arithmetic)."""
    before, after = ran * rule.per_node, left * rule.per_node
    kept = accum_for(rule.grad_accum, before, after)
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


def size(decision: rules.Decision, environ: Mapping[str, str]) -> Size | None:
    """The smaller size of a requeued job that goes on with fewer nodes, else None."""
    return size_for(decision, slurm_env.tasks_per_node(environ))


def size_for(decision: rules.Decision, per_node: int | None) -> Size | None:
    """The smaller size of a requeued job that goes on with fewer nodes, at `per_node` tasks each; else None."""
    if decision.nodes is None or per_node is None:
        return None
    return Size(decision.nodes, decision.nodes * per_node)
