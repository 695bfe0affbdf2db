"""The checkpoint formats installed, and what needs to ask them: which format a checkpoint is, and which
checkpoint of a folder a run can resume. The formats come from the registry (hpc_ddp.registry, entry point
group `hpc_ddp.checkpoint_formats`): the kit's own (FORMATS) first, then any installed package's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_ddp import registry
from hpc_ddp.errors import CheckpointError
from hpc_ddp.run.checkpoint import store
from hpc_ddp.run.checkpoint.format import Format
from hpc_ddp.run.checkpoint.full import Full
from hpc_ddp.run.checkpoint.sharded import Sharded
from hpc_ddp.run.checkpoint.storage import LOCAL, Storage

FORMATS: tuple[type[Format], ...] = (Full, Sharded)  # the kit's own (registry.BUILTINS names the same)


def for_run(cfg: Any, folder: Path, env: Any, storage: Storage = LOCAL) -> Format:
    """The format this run writes (--checkpoint-format, auto resolved by --strategy), into `storage`."""
    return named(cfg.format_name()).for_run(cfg, folder, env, storage)


def named(name: str) -> type[Format]:
    """The format class called `name` (a built-in's or a plugin's: its module imported now)."""
    found: type[Format] = registry.checkpoint_formats.load(name)
    return found


def format_of(path: Path, preferred: type[Format] | None = None) -> type[Format]:
    """The format of checkpoint `path`: `preferred` (the run's own) when it owns it, else the first of the kit's
    that does; CheckpointError if no format the kit knows reads it."""
    if preferred is not None and preferred.owns(path):
        return preferred
    for fmt in FORMATS:
        if fmt.owns(path):
            return fmt
    kind = "a directory" if path.is_dir() else "a file"
    raise CheckpointError(
        f"checkpoint {path} is {kind} that no checkpoint format of this kit reads "
        f"({', '.join(f.name for f in FORMATS)}). Fix: --resume PATH of a checkpoint it reads, or another --folder"
    )


def verify(path: Path) -> None:
    """Raise what loading `path` would (CheckpointCorrupt, CheckpointRefused, CheckpointError); rank 0 checks
    a checkpoint this way before every rank loads it."""
    format_of(path).verify(path)


def find_resumable(folder: str | os.PathLike[str], warn: Callable[[str], None]) -> Path | None:
    """The newest checkpoint of `folder` that loads, starting at `latest`; each bad one is reported and skipped.
    An unreadable `latest` is reported and the checkpoints are tried newest first."""
    candidates = store.list_checkpoints(folder)
    latest = store.read_latest(folder, warn)
    if latest is not None:
        candidates = [latest] + [p for p in candidates if p != latest]
    for path in candidates:
        try:
            verify(path)
            return path
        except CheckpointError as e:
            warn(f"{e}; trying the previous checkpoint")
    return None


def open_checkpoint(
    path: Path, verify: bool = True, storage: Storage = LOCAL, preferred: type[Format] | None = None
) -> Any:
    """Checkpoint `path` read back from `storage` by its own format (`Opened`: meta, each part's state): the
    run's (`preferred`) when it owns it."""
    return format_of(path, preferred).open(path, verify=verify, storage=storage)
