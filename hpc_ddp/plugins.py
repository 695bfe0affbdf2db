"""The public plugin API: the interfaces a package implements to extend the kit, the built-ins to derive from,
and the registries that find them by name (docs/plugins.md has a worked example).

    kind          interface    built-ins                  entry point group             chosen by
    strategy      Strategy     DDPStrategy, FSDPStrategy  hpc_ddp.strategies            --strategy NAME
    checkpoint    Format       FullFormat, ShardedFormat  hpc_ddp.checkpoint_formats    --checkpoint-format NAME
    storage       Storage      LocalStorage               hpc_ddp.storages              --checkpoint-storage NAME
    sink          Sink         (wandb, mlflow)            hpc_ddp.sinks                 --tracker NAME[,NAME]
    scheduler     Scheduler    (slurm, local)             hpc_ddp.schedulers            hpc_ddp.scheduler.of(NAME)

A package declares its classes as entry points of those groups (in its pyproject.toml,
`[project.entry-points."hpc_ddp.strategies"] my-ddp = "my_pkg.strategy:MyDDP"`); once it is installed, its
names are taken by the options, listed by `--help`, and checked as the kit's own are. The kit's own classes are
found through the same registries (listed first). A class derived from a built-in that overrides nothing
behaves exactly as the built-in does, bit for bit.

Importing this module is cheap: each class is imported when first asked for (torch only with a strategy or a
format), and the registries (`strategies`, `checkpoint_formats`, `storages`, `sinks`, `schedulers`: each one's
`names()`, `load(name)`) name what is installed without importing any plugin (hpc_ddp.registry).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpc_ddp.registry import (
    PluginError,
    Registry,
    checkpoint_formats,
    schedulers,
    sinks,
    storages,
    strategies,
)

__all__ = [
    "DDPStrategy",
    "FSDPStrategy",
    "Format",
    "FullFormat",
    "LocalStorage",
    "PluginError",
    "Registry",
    "Scheduler",
    "ShardedFormat",
    "Sink",
    "Storage",
    "Strategy",
    "checkpoint_formats",
    "schedulers",
    "sinks",
    "storages",
    "strategies",
]

if TYPE_CHECKING:
    from hpc_ddp.run.checkpoint.format import Format
    from hpc_ddp.run.checkpoint.full import Full as FullFormat
    from hpc_ddp.run.checkpoint.sharded import Sharded as ShardedFormat
    from hpc_ddp.run.checkpoint.storage import Local as LocalStorage
    from hpc_ddp.run.checkpoint.storage import Storage
    from hpc_ddp.run.sinks.base import Sink
    from hpc_ddp.run.strategy.base import Strategy
    from hpc_ddp.run.strategy.ddp import DDPStrategy
    from hpc_ddp.run.strategy.fsdp import FSDPStrategy
    from hpc_ddp.scheduler.base import Scheduler

# public name -> (the module that defines it, its name there), imported on first use (PEP 562)
_PUBLIC = {
    "Strategy": ("hpc_ddp.run.strategy.base", "Strategy"),
    "DDPStrategy": ("hpc_ddp.run.strategy.ddp", "DDPStrategy"),
    "FSDPStrategy": ("hpc_ddp.run.strategy.fsdp", "FSDPStrategy"),
    "Format": ("hpc_ddp.run.checkpoint.format", "Format"),
    "FullFormat": ("hpc_ddp.run.checkpoint.full", "Full"),
    "ShardedFormat": ("hpc_ddp.run.checkpoint.sharded", "Sharded"),
    "Storage": ("hpc_ddp.run.checkpoint.storage", "Storage"),
    "LocalStorage": ("hpc_ddp.run.checkpoint.storage", "Local"),
    "Sink": ("hpc_ddp.run.sinks.base", "Sink"),
    "Scheduler": ("hpc_ddp.scheduler.base", "Scheduler"),
}


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        import importlib

        module, attr = _PUBLIC[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'hpc_ddp.plugins' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
