"""The checkpoint store: names, `latest`, listing, rotation and leftovers, whatever the format. No torch.

The naming rule, the one place it is written: checkpoint `step` of a run is `checkpoints/ckpt-<step:08d>.pt`
when it is one file (the "full" format) or `checkpoints/ckpt-<step:08d>/` when it is a directory (a format
whose ranks each write their own shards). A name is only ever given to a complete checkpoint: a format writes
under a temporary name (`.<name>.tmp-...`, never listed) and renames it into place when it is whole, then
`promote` points `latest` at it and rotates. So "listed" means "complete", for files and directories alike.

`best` (--keep-best) names the checkpoint with the best evaluation value so far, beside `latest`: written the
same way (atomically, once the checkpoint it names is durable and promoted), and rotation never deletes the
checkpoint it names; the `keep` newest are kept besides it.

Every name is made, read, listed and deleted through the run's storage (hpc_ddp.run.checkpoint.storage), which
every function here is handed: a `CheckpointStore` (the run folder and its storage, `of_run`), built once per
process from --checkpoint-storage, carries it to every reader. Supervisors (the local launcher, the Slurm batch step) import this
module for `latest_step`, so it and its package's `__init__` import no torch
(tests/test_run_checkpoint_store.py checks it in a fresh interpreter).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp import registry
from hpc_ddp.errors import UsageError
from hpc_ddp.run.checkpoint.durable import checksum_path
from hpc_ddp.run.checkpoint.storage import Storage
from hpc_ddp.run.folder import CHECKPOINTS

LATEST = "latest"
BEST = "best"
# A directory checkpoint's manifest (the sharded format writes it last): every file's checksum and `meta`,
# what the checkpoint was written with. JSON, so a supervisor reads `meta` without torch (`written_with`).
MANIFEST = "hpc_ddp-manifest.json"
FILE_SUFFIX = ".pt"
_NAME = re.compile(r"^ckpt-(\d{8,})(\.pt)?$")


def ckpt_dir(folder: str | os.PathLike[str]) -> Path:
    return Path(folder) / CHECKPOINTS


def ckpt_name(step: int, suffix: str = FILE_SUFFIX) -> str:
    """The name of checkpoint `step`: a file `ckpt-<step>.pt`, or with `suffix=""` a directory `ckpt-<step>`."""
    return f"ckpt-{step:08d}{suffix}"


def ckpt_step(path: Path) -> int:
    """The optimizer step in a checkpoint's name (-1 for a name that is no checkpoint's)."""
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else -1


def is_checkpoint(path: Path, storage: Storage) -> bool:
    """`path` is a checkpoint by the naming rule: `ckpt-<step>.pt` a file, `ckpt-<step>` a directory."""
    match = _NAME.match(path.name)
    if match is None:
        return False
    return storage.isfile(str(path)) if match.group(2) else storage.isdir(str(path))


def list_checkpoints(folder: str | os.PathLike[str], storage: Storage) -> list[Path]:
    """Complete checkpoints of a run (files and directories), newest (highest step) first. Temporary names
    are never listed."""
    directory = ckpt_dir(folder)
    found = [(ckpt_step(p), p) for p in map(directory.joinpath, storage.listdir(str(directory)))]
    return [p for step, p in sorted(found, reverse=True) if step >= 0 and is_checkpoint(p, storage)]


def read_latest(
    folder: str | os.PathLike[str], storage: Storage, warn: Callable[[str], None] | None = None
) -> Path | None:
    """The checkpoint `latest` points to, if the pointer exists and names an existing checkpoint. A pointer that
    cannot be read (not UTF-8, a directory, an I/O error) counts as none; `warn` hears about it."""
    return _read_pointer(folder, LATEST, warn, storage)


def read_best(folder: str | os.PathLike[str], storage: Storage) -> Path | None:
    """The checkpoint `best` points to (--keep-best), if the pointer exists and names an existing checkpoint."""
    return _read_pointer(folder, BEST, None, storage)


def _read_pointer(
    folder: str | os.PathLike[str], name: str, warn: Callable[[str], None] | None, storage: Storage
) -> Path | None:
    pointer = ckpt_dir(folder) / name
    try:
        text = storage.read_bytes(str(pointer)).decode("utf-8")
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # IsADirectoryError, UnicodeDecodeError, EIO...
        if warn is not None:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
            warn(f"{pointer} is unreadable ({reason}); using the newest checkpoint that loads instead")
        return None
    target = text.strip()
    path = ckpt_dir(folder) / target
    if target and "/" not in target and is_checkpoint(path, storage):
        return path
    if warn is not None and target:
        warn(
            f"{pointer} names {target[:80]!r}, which is not a checkpoint of this folder; using the newest "
            "checkpoint that loads instead"
        )
    return None


def resolve(path: str | os.PathLike[str], storage: Storage) -> Path:
    """`path` itself, or, for a `latest` or `best` pointer (`<folder>/checkpoints/best`), the checkpoint it names:
    a pointer works wherever a checkpoint path does. The one resolver of every entry point that takes one
    (`--resume PATH`, `checkpoint export`, `hpc_ddp.checkpoint.load_model`, `full.load`), read from `storage`.
    UsageError for a pointer that names no checkpoint beside it."""
    path = Path(path)
    if path.name not in (LATEST, BEST) or not storage.isfile(str(path)):
        return path
    try:
        target = storage.read_bytes(str(path)).decode("utf-8").strip()
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise UsageError(f"{path}: the {path.name} pointer cannot be read ({reason})") from e
    named = path.parent / target
    if not target or "/" in target or not is_checkpoint(named, storage):
        raise UsageError(
            f"{path} names {target[:80]!r}, which is not a checkpoint beside it. Fix: give a ckpt-<step> "
            f"path of {path.parent}"
        )
    return named


def latest_step(folder: str | os.PathLike[str], storage: Storage) -> int | None:
    """The step of the run's latest checkpoint: the one `latest` names, else the newest listed; None if there
    is none. The rule supervisors use (no torch)."""
    try:
        path = read_latest(folder, storage=storage)
        if path is None:
            listed = list_checkpoints(folder, storage)
            path = listed[0] if listed else None
    except OSError:
        return None
    return ckpt_step(path) if path is not None else None


def install(temp: Path, final: Path, storage: Storage) -> None:
    """Give the complete checkpoint folder `temp` its final name `final`, durably (Storage.install: a
    checkpoint of the same step already there, the step saved again with a later state, is replaced). Rank 0
    alone renames."""
    storage.install(str(temp), str(final))


def point_latest(folder: str | os.PathLike[str], path: Path, storage: Storage) -> None:
    """Make `latest` name `path` (atomically: readers see the old name or the new one)."""
    storage.write_bytes(str(ckpt_dir(folder) / LATEST), (path.name + "\n").encode())


def promote(folder: str | os.PathLike[str], path: Path, keep: int, storage: Storage) -> None:
    """`path` is complete and durable under its final name: point `latest` at it, then drop all but the newest
    `keep` of its line (and the one `best` names, which is never dropped).

    Rotation keeps this checkpoint and the `keep - 1` newest before it. It never deletes one with a higher step:
    such a checkpoint is no part of the line this run continues (a start from an earlier checkpoint sets those
    aside first, `resume.apply`), and deleting by step number alone once deleted the file just written."""
    point_latest(folder, path, storage)
    rotate(folder, ckpt_step(path), keep, storage)


def point_best(folder: str | os.PathLike[str], path: Path, keep: int, storage: Storage) -> None:
    """`path` (complete, durable, promoted) has the best evaluation value so far: make `best` name it
    (atomically), then rotate again, so that the checkpoint it named before goes if it is no longer among the
    `keep` newest."""
    storage.write_bytes(str(ckpt_dir(folder) / BEST), (path.name + "\n").encode())
    latest = read_latest(folder, storage=storage)
    if latest is not None:
        rotate(folder, ckpt_step(latest), keep, storage)


def rotate(folder: str | os.PathLike[str], newest: int, keep: int, storage: Storage) -> None:
    """Drop the checkpoints before step `newest` beyond the `keep - 1` newest of them, except the one `best`
    names (--keep-best: beside the `keep` ones, not one of them)."""
    best = read_best(folder, storage)
    older = [p for p in list_checkpoints(folder, storage) if ckpt_step(p) < newest and p != best]
    for old in older[keep - 1 :]:
        remove(old, storage)


def remove(path: Path, storage: Storage) -> None:
    """Delete a checkpoint: a file and its checksum, or a directory and everything in it."""
    storage.remove(str(path))


def move(path: Path, into: Path, storage: Storage) -> None:
    """Move a checkpoint (and its checksum, if it has one) into the folder `into`, keeping its name."""
    storage.rename(str(path), str(into / path.name))
    sums = checksum_path(path)
    if storage.isfile(str(sums)):
        storage.rename(str(sums), str(into / sums.name))


def remove_stale_temporaries(folder: str | os.PathLike[str], storage: Storage) -> int:
    """Delete temporary files and directories a killed writer left behind (rank 0 at start, before any new
    save). They were never promoted: nothing points at them."""
    directory = ckpt_dir(folder)
    stale = [n for n in storage.listdir(str(directory)) if n.startswith(".") and ".tmp-" in n]
    for name in stale:
        storage.remove(str(directory / name))
    return len(stale)


def newest_size(folder: str | os.PathLike[str], storage: Storage) -> int:
    """Bytes of the newest complete checkpoint (0 if none): about what the next one needs on disk."""
    listed = list_checkpoints(folder, storage)
    if not listed:
        return 0
    try:
        return storage.size(str(listed[0]))
    except OSError:
        return 0


def written_with(path: Path, storage: Storage) -> dict[str, Any] | None:
    """The `meta` a directory checkpoint's manifest records (world size, config), or None when `path` has no
    readable one (a one-file checkpoint, a torn one). No torch, no checksum check: for what a supervisor tells."""
    try:
        meta = json.loads(storage.read_bytes(str(path / MANIFEST)).decode("utf-8")).get("meta")
    except (OSError, ValueError, AttributeError):
        return None
    return meta if isinstance(meta, dict) else None


@dataclass(frozen=True)
class CheckpointStore:
    """A run's checkpoints: its folder and the storage they are kept in. Built once per process (`of_run`, from
    --checkpoint-storage) and handed to every reader (the trainer, the resume, the supervisors, --min-nodes, the
    doctor, the checkpoint tools), so that none of them reads a checkpoint name past the run's storage."""

    folder: Path  # the run folder; its checkpoints are in `directory`
    storage: Storage

    @property
    def directory(self) -> Path:
        return ckpt_dir(self.folder)

    def listed(self) -> list[Path]:
        return list_checkpoints(self.folder, self.storage)

    def latest(self, warn: Callable[[str], None] | None = None) -> Path | None:
        return read_latest(self.folder, self.storage, warn)

    def best(self) -> Path | None:
        return read_best(self.folder, self.storage)

    def latest_step(self) -> int | None:
        return latest_step(self.folder, self.storage)

    def resolve(self, path: str | os.PathLike[str]) -> Path:
        return resolve(path, self.storage)


def storage_named(name: str) -> Storage:
    """The storage --checkpoint-storage `name` names: its class (a built-in's or a plugin's, hpc_ddp.registry),
    built with no arguments (its own settings are its own, from the environment). No torch."""
    built: Storage = registry.storages.load(name)()
    return built


def of_run(folder: str | os.PathLike[str], storage: str) -> CheckpointStore:
    """The checkpoint store of the run in `folder` whose --checkpoint-storage is `storage` (a name)."""
    return CheckpointStore(Path(folder), storage_named(storage))
