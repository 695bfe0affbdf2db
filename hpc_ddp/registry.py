"""The registries of the kit's extension points: which strategies, checkpoint formats, storages, sinks and
schedulers are installed, by name, from Python entry points (the public side: hpc_ddp.plugins, docs/plugins.md).

    hpc_ddp.strategies          --strategy             a class deriving from hpc_ddp.plugins.Strategy
    hpc_ddp.checkpoint_formats  --checkpoint-format    ... from Format
    hpc_ddp.storages            --checkpoint-storage   ... from Storage
    hpc_ddp.sinks               --tracker              ... from Sink
    hpc_ddp.schedulers          (the supervisors)      ... from Scheduler

The kit's own classes come through the same registry, listed first (as submitit lists its own executors):
pyproject.toml declares them as entry points of the `hpc-ddp` distribution, and where that distribution's
metadata does not declare them (a source checkout never installed, an install made before they were) the
table BUILTINS below stands in for them, the same names and classes. Another distribution's entry points come
after, sorted by distribution and name; a name already taken is kept by its first owner.

Names are resolved without importing anything: an entry point's value ("module:Class") is imported when the
class is first asked for (a strategy's module pulls torch, which `--help` and the submitters never pay for).
A plugin whose module fails to import is one line naming its distribution and the error (`PluginError`, a
usage error), for that name alone: the others load. Base layer: no torch, no other hpc_ddp module but errors.
"""

from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from hpc_ddp.errors import UsageError

KIT = "hpc-ddp"  # the kit's own distribution: its entry points are the built-ins

# group -> the built-ins, name -> "module:Class" (pyproject.toml's [project.entry-points.<group>], the same;
# tests/test_plugins.py checks that they agree).
BUILTINS: dict[str, dict[str, str]] = {
    "hpc_ddp.strategies": {
        "ddp": "hpc_ddp.run.strategy.ddp:DDPStrategy",
        "fsdp": "hpc_ddp.run.strategy.fsdp:FSDPStrategy",
    },
    "hpc_ddp.checkpoint_formats": {
        "full": "hpc_ddp.run.checkpoint.full:Full",
        "sharded": "hpc_ddp.run.checkpoint.sharded:Sharded",
    },
    "hpc_ddp.storages": {"local": "hpc_ddp.run.checkpoint.storage:Local"},
    "hpc_ddp.sinks": {
        "wandb": "hpc_ddp.run.sinks.wandb_run:WandbRun",
        "mlflow": "hpc_ddp.run.sinks.mlflow_run:MlflowRun",
    },
    "hpc_ddp.schedulers": {
        "slurm": "hpc_ddp.scheduler.slurm.client:SlurmClient",
        "local": "hpc_ddp.scheduler.local:LocalScheduler",
    },
}

# What the config checks ask of a built-in class before any run (a class attribute each), here so that the
# submitters' and supervisors' checks stay without torch: a built-in's module imports it. A plugin's class is
# imported and asked (tests/test_plugins.py checks that this table says what the classes declare).
BUILTIN_TRAITS: dict[str, dict[str, dict[str, Any]]] = {
    "hpc_ddp.strategies": {"ddp": {"shards_model": False}, "fsdp": {"shards_model": True}},
    "hpc_ddp.checkpoint_formats": {
        "full": {"shards": False, "reshards": False},
        "sharded": {"shards": True, "reshards": True},
    },
}


class PluginError(UsageError):
    """A plugin's class could not be imported: its distribution and the error, in one line."""


@dataclass(frozen=True)
class Entry:
    """One name of a registry: where its class is ("module:Class") and the distribution that declared it."""

    name: str
    value: str
    dist: str  # the distribution's name; KIT for a built-in

    @property
    def builtin(self) -> bool:
        return self.dist == KIT


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _declared(group: str) -> list[Entry]:
    """The entry points of `group` in this Python's installed distributions (and on sys.path: a dist-info
    folder there counts)."""
    return [e for g, e in _all_declared(tuple(sys.path)) if g == group]


@functools.lru_cache(maxsize=8)
def _all_declared(path: tuple[str, ...]) -> tuple[tuple[str, Entry], ...]:
    """(group, entry) for every entry point of the kit's groups, read once per sys.path: reading the metadata
    costs milliseconds, and the config checks ask on every TrainConfig."""
    found = []
    for group in BUILTINS:
        for ep in metadata.entry_points(group=group):
            dist = getattr(ep, "dist", None)
            name = (dist.metadata["Name"] if dist is not None else None) or "?"
            found.append((group, Entry(ep.name, ep.value, KIT if _normalized(name) == KIT else name)))
    return tuple(found)


class Registry:
    """The classes of one extension point by name (`flag`: the option that names them, for the messages)."""

    def __init__(self, group: str, flag: str) -> None:
        self.group, self.flag = group, flag
        self._loaded: dict[str, type] = {}

    def entries(self) -> dict[str, Entry]:
        """Every name installed, by name: the built-ins first, then the other distributions' (read again when
        sys.path changes: a test may put a plugin on it)."""
        declared = _declared(self.group)
        own = [e for e in declared if e.builtin]
        if not own:  # no metadata of the kit's own (a source checkout, an older install): the same table
            own = [Entry(name, value, KIT) for name, value in BUILTINS.get(self.group, {}).items()]
        # In the table's order whatever the metadata's (an installer may sort entry_points.txt): the default first.
        order = list(BUILTINS.get(self.group, {}))
        own.sort(key=lambda e: order.index(e.name) if e.name in order else len(order))
        others = sorted((e for e in declared if not e.builtin), key=lambda e: (e.dist, e.name))
        found: dict[str, Entry] = {}
        for entry in own + others:
            found.setdefault(entry.name, entry)
        return found

    def names(self) -> tuple[str, ...]:
        return tuple(self.entries())

    def entry(self, name: str) -> Entry:
        """The entry called `name`; a usage error listing the names installed when there is none."""
        found = self.entries()
        if name not in found:
            raise UsageError(
                f"{self.flag} {name}: choose one of {', '.join(found)} (the names installed, entry point group "
                f"{self.group}; another comes with the package that provides it)"
            )
        return found[name]

    def load(self, name: str) -> type:
        """The class called `name`, its module imported now (once)."""
        if name in self._loaded:
            return self._loaded[name]
        entry = self.entry(name)
        module, _, attr = entry.value.partition(":")
        try:
            found: Any = importlib.import_module(module)
            for part in attr.split(".") if attr else []:
                found = getattr(found, part)
        except Exception as e:  # anything a plugin's import raises: said in one line, the others still load
            raise PluginError(
                f"{self.flag} {name}: the plugin from package {entry.dist} ({entry.value}) failed to import: "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. Fix: repair or reinstall "
                f"{entry.dist}, or use another of: {', '.join(n for n in self.entries() if n != name)}"
            ) from e
        self._loaded[name] = found
        return found  # type: ignore[no-any-return]

    def trait(self, name: str, attr: str) -> Any:
        """What the class called `name` declares as `attr` (a class attribute): a built-in's from
        BUILTIN_TRAITS, without importing it; another's from its class, imported now."""
        entry = self.entry(name)
        table = BUILTIN_TRAITS.get(self.group, {})
        if entry.builtin and name in table and attr in table[name] and name not in self._loaded:
            return table[name][attr]
        return getattr(self.load(name), attr)

    def help(self) -> str:
        """The names installed, for --help."""
        return ", ".join(self.names())


strategies = Registry("hpc_ddp.strategies", "--strategy")
checkpoint_formats = Registry("hpc_ddp.checkpoint_formats", "--checkpoint-format")
storages = Registry("hpc_ddp.storages", "--checkpoint-storage")
sinks = Registry("hpc_ddp.sinks", "--tracker")
schedulers = Registry("hpc_ddp.schedulers", "scheduler")

ALL = (strategies, checkpoint_formats, storages, sinks, schedulers)
