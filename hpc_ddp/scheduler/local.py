"""The local launcher's scheduler: an emulated srun step on this machine, and the scheduler interface as it
answers there (hpc_ddp.scheduler.base.Scheduler).

The emulated step: every rank gets the SLURM_* variables of a real `srun --nodes N --ntasks-per-node T` step
(`slurm_env`: a fresh fake job id per run, node list `127.0.0.[1-N]`, which resolves everywhere without
editing /etc/hosts, node/proc/local ids and counts), so `hpc_ddp.cluster.env.detect` takes its Slurm path: the
same code as a cluster job. A restart raises SLURM_RESTART_COUNT, as Slurm's requeue does.

The interface: who am I reads the same variables; nothing is queued, accounted, cancelled or requeued by a
command (the launcher itself starts the ranks again after a preemption or a failure: hpc_ddp.launch.local),
every emulated node is usable, and a node to exclude is only recorded (attempts.jsonl).
Pure, but for `fresh_job_id` (which probes a port).
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from hpc_ddp.cluster.env import SLURM_RESTART_VAR, port_for_job
from hpc_ddp.scheduler.base import Done, Identity, Size, StepEnd, Window
from hpc_ddp.scheduler.slurm import env as slurm_env_vars

NO_COMMAND = "a local run has no scheduler to ask: its launcher starts the ranks again itself"


class Step(Protocol):
    """The shape of an emulated srun step (hpc_ddp.launch.local.srun_env.LocalJob is one)."""

    job_id: str
    nodes: int
    tasks_per_node: int

    @property
    def world_size(self) -> int: ...


def nodelist(nodes: int) -> str:
    return "127.0.0.1" if nodes == 1 else f"127.0.0.[1-{nodes}]"


def node_name(node: int) -> str:
    """The name emulated node `node` (0-based) has in SLURMD_NODENAME and SLURM_JOB_NODELIST."""
    return f"127.0.0.{node + 1}"


def slurm_env(job: Step, rank: int, restarts: int, nodes: Sequence[str] = ()) -> dict[str, str]:
    """The SLURM_* variables `srun --nodes N --ntasks-per-node T` gives task `rank` (pure). `nodes`: the
    emulated nodes the step runs on, when not the first N (a spare in place of a blamed one, --spare-nodes)."""
    node, local = divmod(rank, job.tasks_per_node)
    hosts = ",".join(nodes) if nodes else nodelist(job.nodes)
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
        "SLURMD_NODENAME": nodes[node] if nodes else node_name(node),
        "SLURM_CPUS_ON_NODE": str(os.cpu_count() or 1),
    }
    if restarts:
        env[SLURM_RESTART_VAR] = str(restarts)  # unset on the first run, as in Slurm
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


class LocalScheduler:
    """The scheduler interface on this machine, for a job of `nodes` emulated nodes (see the module docstring)."""

    name = "local"

    def __init__(self, nodes: int = 1) -> None:
        self.nodes = nodes

    @classmethod
    def detect(cls, launcher: str, requeue_by: str) -> bool:
        return requeue_by == "launcher"  # the local launcher tells its ranks so: their job id is fake

    def identity(self, environ: Mapping[str, str]) -> Identity:
        return slurm_env_vars.identity(environ)  # the emulated step's variables are srun's

    def version(self) -> str | None:
        return None

    def requeue(self, job: str) -> Done:
        return Done(False, NO_COMMAND)

    def can_requeue(self) -> bool:
        return False

    def runs(self, job: str) -> list[Window] | None:
        return None  # no accounting: the launcher saw every run itself

    def queued(self, jobs: Sequence[str]) -> dict[str, tuple[Any, str]] | None:
        return {}  # nothing waits in a queue: a second run in the folder is refused by its lock

    def usable(self, exclude: Sequence[str] = (), partition: str = "") -> list[str]:
        return [n for n in (node_name(i) for i in range(self.nodes)) if n not in exclude]

    def submit(self, submission: Any, call: Any) -> str:
        raise NotImplementedError(f"{NO_COMMAND}: `submit --local` runs the job here (hpc_ddp.launch.local)")

    def cancel(self, job: str, signal: str = "") -> Done:
        return Done(False, NO_COMMAND)

    def requeue_excluding(
        self,
        job: str,
        exclude: Sequence[str],
        excluded: Sequence[str] = (),
        already: bool = False,
        size: Size | None = None,
    ) -> Done:
        return Done(False, f"{NO_COMMAND}; the nodes blamed are recorded in attempts.jsonl only")

    def step_end(self, lines: Sequence[str]) -> StepEnd:
        return StepEnd()  # no step launcher: the local launcher saw each rank end itself

    def lost(
        self, job: str, nodes: Sequence[str], said: Sequence[str], restart: int, view: Any = None
    ) -> tuple[str, ...]:
        return tuple(dict.fromkeys(said))  # no node fails under a run on one machine but as said
