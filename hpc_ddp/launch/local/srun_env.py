"""The emulated srun step: what `srun --nodes N --ntasks-per-node T` gives each task, for the local launcher.

Every child gets the SLURM_* variables of a real srun step (a fresh fake job id per run, node list
`127.0.0.[1-N]`, which resolves everywhere without editing /etc/hosts, node/proc/local ids and counts), so
`hpc_ddp.cluster.env.detect` takes its Slurm path: the same code as a cluster job. A restart raises
SLURM_RESTART_COUNT, as Slurm's requeue does. Pure, but for `fresh_job_id` (which probes a port).
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass, field
from pathlib import Path

from hpc_ddp.cluster import allocator
from hpc_ddp.cluster.env import SLURM_RESTART_VAR, port_for_job, without_launcher

# After Ctrl-C/SIGTERM to the launcher: how long the ranks get to save and exit before SIGKILL (Slurm's
# KillWait).
STOP_GRACE_S = 30.0


@dataclass(frozen=True)
class LocalJob:
    nodes: int
    tasks_per_node: int
    folder: Path
    train_argv: list[str]
    max_requeue: int  # preemptions after which the job is not started again (--max-requeue)
    all_ranks: bool = False
    job_id: str = ""
    module: str = "hpc_ddp.train"
    extra_env: dict[str, str] = field(default_factory=dict)
    stop_grace_s: float = (
        STOP_GRACE_S  # Ctrl-C/SIGTERM: how long the ranks get to save and exit before SIGKILL
    )
    max_restarts: int = 0  # failures after which the job is not started again (--max-restarts)
    records: bool = False  # append every attempt's end to attempts.jsonl (training runs)
    resume_command: str = ""  # the shell line that resumes this run, said after a stop or a failure

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


def nodelist(nodes: int) -> str:
    return "127.0.0.1" if nodes == 1 else f"127.0.0.[1-{nodes}]"


def slurm_env(job: LocalJob, rank: int, restarts: int) -> dict[str, str]:
    """The SLURM_* variables `srun --nodes N --ntasks-per-node T` gives task `rank` (pure)."""
    node, local = divmod(rank, job.tasks_per_node)
    hosts = nodelist(job.nodes)
    per_node = f"{job.tasks_per_node}(x{job.nodes})" if job.nodes > 1 else str(job.tasks_per_node)
    env = {
        "SLURM_JOB_ID": job.job_id,
        "SLURM_JOBID": job.job_id,
        "SLURM_JOB_NAME": "hpc_ddp-local",
        "SLURM_JOB_NODELIST": hosts,
        "SLURM_NODELIST": hosts,
        "SLURM_JOB_NUM_NODES": str(job.nodes),
        "SLURM_NNODES": str(job.nodes),
        "SLURM_NTASKS": str(job.world_size),
        "SLURM_NPROCS": str(job.world_size),
        "SLURM_TASKS_PER_NODE": per_node,
        "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0",
        "SLURM_STEP_NODELIST": hosts,
        "SLURM_STEP_NUM_NODES": str(job.nodes),
        "SLURM_STEP_NUM_TASKS": str(job.world_size),
        "SLURM_STEP_TASKS_PER_NODE": per_node,
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(local),
        "SLURM_NODEID": str(node),
        "SLURMD_NODENAME": f"127.0.0.{node + 1}",
        "SLURM_CPUS_ON_NODE": str(os.cpu_count() or 1),
    }
    if restarts:
        env[SLURM_RESTART_VAR] = str(restarts)  # unset on the first run, as in Slurm
    return env


def child_environ(base: dict[str, str], job: LocalJob, rank: int, restarts: int) -> dict[str, str]:
    """The parent's environment minus any launcher variables (and the kit's channels) it carries, plus this
    rank's fake srun step, the job's own settings (`extra_env`) and the kit's allocator settings
    (hpc_ddp.cluster.allocator)."""
    env = without_launcher(base)
    env.update(slurm_env(job, rank, restarts))
    env.update(job.extra_env)
    env.update(allocator.for_ranks(env))  # malloc's settings for ranks, unless the user set them
    env["PYTHONUNBUFFERED"] = "1"
    return env


def fresh_job_id() -> str:
    """A random fake job id whose derived port is free on loopback right now."""
    for _ in range(50):
        job_id = str(random.randint(1_000_000, 9_999_999))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port_for_job(job_id)))
            except OSError:
                continue
        return job_id
    raise RuntimeError("no free port found for the local run in 50 tries")
