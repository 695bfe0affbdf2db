"""What Slurm's variables say about the job as a whole (pure: the environment is an argument).

A task learns its own place from hpc_ddp.cluster.env (`detect`); the processes that are no task of the step ask
here about the job: the batch shell's steps (hpc_ddp.launch.slurm.batch: its id, restart count, node count,
--ntasks-per-node, the directory srun starts the tasks in) and rank 0 recording the job's nodes. The names are
the one table of launcher variables, hpc_ddp.cluster.env.SLURM_VARS.
"""

from __future__ import annotations

from collections.abc import Mapping

from hpc_ddp.cluster import hostlist
from hpc_ddp.cluster.env import SLURM_VARS, restart_count, slurm_job_id
from hpc_ddp.scheduler.base import Identity


def value(environ: Mapping[str, str], field: str) -> str:
    """The first of the table's names for `field` that is set, stripped; "" when none is."""
    for name in SLURM_VARS[field]:
        text = environ.get(name, "").strip()
        if text:
            return text
    return ""


def job_id(environ: Mapping[str, str]) -> str:
    """The job's id, an array element's as ARRAY_TASK (hpc_ddp.cluster.env.slurm_job_id); "" outside a job."""
    return (slurm_job_id(environ) or "").strip()


def job_nodelist(environ: Mapping[str, str]) -> str:
    """The job's node list as Slurm wrote it ("node[1-2]"); "" outside a job."""
    return value(environ, "job_nodelist")


def job_nodes(environ: Mapping[str, str]) -> tuple[str, ...] | None:
    """The job's nodes, in Slurm's order; None when the list is not set or cannot be read."""
    listed = job_nodelist(environ)
    try:
        return tuple(hostlist.expand(listed)) if listed else None
    except ValueError:
        return None


def step_nodes(environ: Mapping[str, str]) -> tuple[str, ...] | None:
    """The nodes of this process's step (SLURM_STEP_NODELIST), else the job's; None when neither is readable.
    A job with spare nodes (--spare-nodes) runs its steps on part of its allocation."""
    listed = value(environ, "nodelist")
    try:
        return tuple(hostlist.expand(listed)) if listed else None
    except ValueError:
        return None


def identity(environ: Mapping[str, str]) -> Identity:
    """Who this process is in its job: the job id, its restart count (hpc_ddp.cluster.env.restart_count: the
    batch shell is no srun step, and counts as its tasks do), its step's nodes (the job's, outside a step)
    and this node."""
    return Identity(
        job_id(environ),
        restart_count(environ),
        step_nodes(environ) or job_nodes(environ) or (),
        value(environ, "node_name"),
    )


def job_size(environ: Mapping[str, str]) -> int | None:
    """How many nodes the job asked for, as the batch environment says (SLURM_JOB_NUM_NODES, else
    SLURM_NNODES: what the submission got); None when neither says."""
    for name in SLURM_VARS["job_num_nodes"]:
        text = environ.get(name, "").strip()
        if text.isdigit() and int(text) > 0:
            return int(text)
    return None


def tasks_per_node(environ: Mapping[str, str]) -> int | None:
    """The job's --ntasks-per-node (SLURM_NTASKS_PER_NODE, which sbatch sets only when it was given)."""
    text = value(environ, "ntasks_per_node")
    return int(text) if text.isdigit() and int(text) > 0 else None


def working_dir(environ: Mapping[str, str]) -> str:
    """Where srun starts the tasks when it was set (`sbatch --chdir`); "" when not."""
    return value(environ, "working_dir")


def array_index(environ: Mapping[str, str]) -> str:
    """This job's index in its job array (SLURM_ARRAY_TASK_ID), as Slurm wrote it; "" outside an array."""
    return value(environ, "array_task_id")


# A job array's batch shell: `$element` is the element's id as the kit names it (ARRAY_INDEX, as
# hpc_ddp.cluster.env.slurm_job_id; the job id of a submission of one trial, which submitit makes a plain job).
ELEMENT_LINE = "element=${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}; element=${element:-$SLURM_JOB_ID}"
