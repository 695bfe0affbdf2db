"""hpc_ddp: take a PyTorch model from one process to many GPUs on many Slurm nodes, correctly.

Entry points: `python -m hpc_ddp.submit` (Slurm via submitit, or `--local`), `python -m hpc_ddp.train` (one
task), `python -m hpc_ddp.doctor`, `python -m hpc_ddp.bench`; `python -m hpc_ddp` lists them.

The public API, importable from here:

    Task, TrainConfig            what to train, and the training options (hpc_ddp.run)
    Callback                     the base of Task.callbacks: hooks into the loop (hpc_ddp.run.callbacks)
    long_work                    mark long legitimate work in the task's own code for the hang watchdog
    detect, DistEnv              this process's place in the job, from the launcher's variables (hpc_ddp.cluster.env)
    ClusterConfigError           what `detect` raises for missing or inconsistent variables (hpc_ddp.errors)

The plugin API (a strategy, checkpoint format, storage, sink or scheduler of your own, found by entry point)
is hpc_ddp.plugins (docs/plugins.md).

Importing this package is cheap: each name is imported when first used (torch only with `Task`), so `--help`
and usage errors answer at once. The layers below are described in docs/architecture.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpc_ddp._version import __version__

__all__ = [
    "Callback",
    "ClusterConfigError",
    "DistEnv",
    "Task",
    "TrainConfig",
    "__version__",
    "detect",
    "long_work",
]

if TYPE_CHECKING:
    from hpc_ddp.cluster.env import DistEnv, detect
    from hpc_ddp.errors import ClusterConfigError
    from hpc_ddp.run.callbacks import Callback
    from hpc_ddp.run.config import TrainConfig
    from hpc_ddp.run.tasks import Task
    from hpc_ddp.run.watch.longwork import long_work

# name -> the module that defines it, imported on first use (PEP 562)
_PUBLIC = {
    "Task": "hpc_ddp.run.tasks",
    "Callback": "hpc_ddp.run.callbacks",
    "long_work": "hpc_ddp.run.watch.longwork",
    "TrainConfig": "hpc_ddp.run.config",
    "detect": "hpc_ddp.cluster.env",
    "DistEnv": "hpc_ddp.cluster.env",
    "ClusterConfigError": "hpc_ddp.errors",
}


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'hpc_ddp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
