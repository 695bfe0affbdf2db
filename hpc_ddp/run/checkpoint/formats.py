"""The checkpoint formats the kit knows, and what needs to ask them: which format a checkpoint is, and which
checkpoint of a folder a run can resume. Adding a format: its module, and one entry in FORMATS.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_ddp.errors import CheckpointError
from hpc_ddp.run.checkpoint import store
from hpc_ddp.run.checkpoint.format import Format
from hpc_ddp.run.checkpoint.full import Full
from hpc_ddp.run.checkpoint.sharded import Sharded
from hpc_ddp.run.checkpoint.storage import LOCAL, Storage

FORMATS: tuple[type[Format], ...] = (Full, Sharded)


def for_run(cfg: Any, folder: Path, env: Any, storage: Storage = LOCAL) -> Format:
    """The format this run writes (--checkpoint-format, auto resolved by --strategy), into `storage`."""
    kind = named(cfg.format_name())
    if kind is Sharded:
        return Sharded(folder, env, cfg.keep, cfg.async_save_kind(), storage)
    return kind(folder, env, cfg.keep, storage)


def named(name: str) -> type[Format]:
    for fmt in FORMATS:
        if fmt.name == name:
            return fmt
    known = ", ".join(f.name for f in FORMATS)
    raise CheckpointError(f"no checkpoint format {name!r}; known: {known}")


def format_of(path: Path) -> type[Format]:
    """The format of checkpoint `path`; CheckpointError if no format the kit knows reads it."""
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


def open_checkpoint(path: Path, verify: bool = True, storage: Storage = LOCAL) -> Any:
    """Checkpoint `path` read back from `storage` by its own format (`Opened`: meta, each part's state)."""
    return format_of(path).open(path, verify=verify, storage=storage)
