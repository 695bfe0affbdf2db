"""The checkpoint formats installed, and what needs to ask them: which format a checkpoint is, and which
checkpoint of a folder a run can resume. The formats come from the registry (hpc_ddp.registry, entry point
group `hpc_ddp.checkpoint_formats`): the kit's own first, then any installed package's.

This is the one place that tells checkpoints apart (each format's `owns`, asked through the run's storage):
the resume, `model.pth`, `hpc_ddp.checkpoint.load_model`, the checkpoint CLI and the resume check ask
`format_of` and then the format itself, never a path's shape or a format's name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hpc_ddp import registry
from hpc_ddp.errors import CheckpointError
from hpc_ddp.run.checkpoint import store
from hpc_ddp.run.checkpoint.format import Format
from hpc_ddp.run.checkpoint.storage import Storage


def for_run(cfg: Any, folder: Path, env: Any, storage: Storage) -> Format:
    """The format this run writes (--checkpoint-format, auto resolved by --strategy), into `storage`."""
    return named(cfg.format_name()).for_run(cfg, folder, env, storage)


def named(name: str) -> type[Format]:
    """The format class called `name` (a built-in's or a plugin's: its module imported now)."""
    found: type[Format] = registry.checkpoint_formats.load(name)
    return found


def _installed() -> Iterator[type[Format]]:
    """Every format installed, the kit's own first; a plugin that fails to import is passed over here (naming
    it by --checkpoint-format says why)."""
    for name in registry.checkpoint_formats.names():
        try:
            yield named(name)
        except registry.PluginError:
            continue


def format_of(path: Path, storage: Storage, preferred: type[Format] | None = None) -> type[Format]:
    """The format of checkpoint `path` in `storage`: `preferred` (the run's own) when it owns it, else the first
    installed that does; CheckpointError if none reads it."""
    if preferred is not None and preferred.owns(path, storage):
        return preferred
    for fmt in _installed():
        if fmt.owns(path, storage):
            return fmt
    kind = "a directory" if storage.isdir(str(path)) else "a file"
    names = ", ".join(registry.checkpoint_formats.names())
    raise CheckpointError(
        f"checkpoint {path} is {kind} that no checkpoint format of this kit reads ({names}). "
        "Fix: --resume PATH of a checkpoint it reads, or another --folder"
    )


def verify(path: Path, storage: Storage, preferred: type[Format] | None = None) -> None:
    """Raise what loading `path` would (CheckpointCorrupt, CheckpointRefused, CheckpointError); rank 0 checks
    a checkpoint this way before every rank loads it."""
    format_of(path, storage, preferred).verify(path, storage)


def find_resumable(checkpoints: store.CheckpointStore, warn: Callable[[str], None]) -> Path | None:
    """The newest checkpoint of the store that loads, starting at `latest`; each bad one is reported and
    skipped. An unreadable `latest` is reported and the checkpoints are tried newest first."""
    candidates = checkpoints.listed()
    latest = checkpoints.latest(warn)
    if latest is not None:
        candidates = [latest] + [p for p in candidates if p != latest]
    for path in candidates:
        try:
            verify(path, checkpoints.storage)
            return path
        except CheckpointError as e:
            warn(f"{e}; trying the previous checkpoint")
    return None


def open_checkpoint(
    path: Path, storage: Storage, verify: bool = True, preferred: type[Format] | None = None
) -> Any:
    """Checkpoint `path` read back from `storage` by its own format (`Opened`: meta, each part's state): the
    run's (`preferred`) when it owns it."""
    return format_of(path, storage, preferred).open(path, storage, verify=verify)
