"""The job's shape: nodes x tasks per node, one task per GPU, validated once for every way to launch it."""

from __future__ import annotations

from dataclasses import dataclass

from hpc_ddp.errors import UsageError


@dataclass(frozen=True)
class JobShape:
    """How many nodes and tasks, validated once for every path (local, submitit, print-sbatch)."""

    nodes: int
    gpus_per_node: int
    tasks_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


def job_shape(nodes: int, gpus_per_node: int, tasks_per_node: int | None) -> JobShape:
    if nodes <= 0:
        raise UsageError(f"--nodes {nodes}: must be at least 1")
    if gpus_per_node < 0:
        raise UsageError(f"--gpus-per-node {gpus_per_node}: must be 0 (CPU job) or more")
    if tasks_per_node is not None and tasks_per_node <= 0:
        raise UsageError(f"--tasks-per-node {tasks_per_node}: must be at least 1")
    if gpus_per_node > 0 and tasks_per_node not in (None, gpus_per_node):
        raise UsageError(
            f"--tasks-per-node {tasks_per_node} conflicts with --gpus-per-node {gpus_per_node}: "
            "hpc_ddp runs one task per GPU. Drop --tasks-per-node (or use --gpus-per-node 0 for CPU)"
        )
    tasks = gpus_per_node if gpus_per_node > 0 else (tasks_per_node or 2)
    return JobShape(nodes, gpus_per_node, tasks)
