"""The local launcher's job and what each rank's process is started with.

`LocalJob` is the job the launcher runs (its shape, run folder, options and budgets); `child_environ` the
environment of one of its ranks: the launcher's own minus any launcher variables it carries, plus the emulated
srun step of hpc_ddp.scheduler.local (`slurm_env`: what `srun --nodes N --ntasks-per-node T` gives the rank),
the job's own settings and the kit's allocator settings. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpc_ddp.cluster import allocator
from hpc_ddp.cluster.env import without_launcher
from hpc_ddp.scheduler.local import slurm_env

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
    checkpoint_storage: str  # --checkpoint-storage: where the supervisor reads the latest checkpoint's step
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
    spare_nodes: int = 0  # emulated nodes beyond `nodes`, taken in place of a blamed one (--spare-nodes)
    strategy: str = (
        "ddp"  # --strategy: which malloc settings its ranks start with (hpc_ddp.cluster.allocator)
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


def child_environ(
    base: dict[str, str], job: LocalJob, rank: int, restarts: int, nodes: Sequence[str] = ()
) -> dict[str, str]:
    """The parent's environment minus any launcher variables (and the kit's channels) it carries, plus this
    rank's fake srun step (on `nodes`, when not the first `job.nodes`), the job's own settings (`extra_env`)
    and the kit's allocator settings (hpc_ddp.cluster.allocator)."""
    env = without_launcher(base)
    env.update(slurm_env(job, rank, restarts, nodes))
    env.update(job.extra_env)
    env.update(allocator.for_ranks(env, job.strategy))  # the strategy's malloc settings, unless the user's
    env["PYTHONUNBUFFERED"] = "1"
    return env
