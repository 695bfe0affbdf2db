"""Which nodes a run of a Slurm job lost, from what Slurm says (the rule behind `SlurmClient.lost`; pure).

The kit's jobs run with `--no-kill` (hpc_ddp.scheduler.slurm.request): when a node fails, Slurm keeps the job and
removes that node from it; the step's tasks are killed ("srun: error: Node failure on node2"). Measured on Slurm
22.05: the job's NodeList then lacks the failed node, and a node Slurm set DOWN that returns at once (a live
slurmd, ReturnToService=2) is idle again before anyone looks, so only srun's line and the job's NodeList still
tell; a drained node is never blamed on its state (hpc_ddp.launch.slurm.lost tells the whole story).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hpc_ddp.scheduler.base import Kind
from hpc_ddp.scheduler.slurm import states as slurm_states
from hpc_ddp.scheduler.slurm.parse import JobInfo


def removed(nodes: Sequence[str], info: JobInfo | None, restart: int) -> tuple[str, ...]:
    """The nodes of run `restart` (`nodes`) that Slurm removed from the job for a failure (pure). Under
    --no-kill a failed node leaves the NodeList of the job, which runs on; a job whose batch host failed
    ends FAILED with Reason JobLaunchFailure and a NodeList without that host (measured). Nothing else
    counts: a job that is ending for any other reason (cancelled, requeued, a time limit) releases its nodes
    one by one, and its NodeList then lacks nodes that did not fail; nor a later run's nodes."""
    if info is None or info.gone or not info.nodes or info.restarts != restart:
        return ()
    if info.state.kind is Kind.RUNNING:
        return tuple(n for n in nodes if n not in info.nodes)
    host = info.batch_host
    # The batch host lost ends the job whether or not its step ran there (--spare-nodes keeps it as a spare).
    if info.state.done and info.reason == "JobLaunchFailure" and host and host not in info.nodes:
        return (host,)
    return ()


def lost_nodes(
    nodes: Sequence[str], said: Sequence[str], info: JobInfo | None, states: Mapping[str, str], restart: int
) -> tuple[str, ...]:
    """The nodes run `restart` on `nodes` lost (pure): those srun said failed (`said`), those Slurm removed
    from the job, and those whose state says failed (down, fail, not responding; never drained), first
    first."""
    failed = [n for n in nodes if slurm_states.node_failed(states.get(n, "idle"))]
    return tuple(dict.fromkeys([*said, *removed(nodes, info, restart), *failed]))
