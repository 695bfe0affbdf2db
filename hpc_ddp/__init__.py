"""hpc_ddp: take a PyTorch model from one process to many GPUs on many Slurm nodes, correctly.

Entry points: `python -m hpc_ddp.submit` (Slurm via submitit, or `--local`), `python -m hpc_ddp.train` (one
task), `python -m hpc_ddp.doctor`, `python -m hpc_ddp.bench`. Importing this package is cheap: torch is only
imported when `Task` is first used, so `--help` and usage errors answer at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Task", "TrainConfig", "__version__"]

if TYPE_CHECKING:
    from hpc_ddp.run.config import TrainConfig
    from hpc_ddp.run.tasks import Task


def __getattr__(name: str) -> Any:
    if name == "Task":
        from hpc_ddp.run.tasks import Task

        return Task
    if name == "TrainConfig":
        from hpc_ddp.run.config import TrainConfig

        return TrainConfig
    raise AttributeError(f"module 'hpc_ddp' has no attribute {name!r}")
