"""Where checkpoints are kept: the few operations the formats and the store ask of a filesystem. No torch.

Every byte of a checkpoint is written through a `Storage`, and every name under `checkpoints/` is made,
listed, renamed and deleted through it: the full format's file (`write`), the sharded format's rank files and
Distributed Checkpoint's shards (DCP's writer for its `dcp_layer`), manifests and the `latest`/`best` pointers (`write_bytes`), the
rename of a complete checkpoint into place (`install`), rotation (`remove`). Reading back, the sharded
format's manifest, index and shards come from it too (`read_bytes`, `sha256`, DCP's reader), and torch files
(the full format's, each rank's file of the sharded format) are read by torch from the stream `open` gives.

`Local` is the filesystem of this machine (a shared one, mounted on every node, for a multi-node run). An object
store or fsspec is one more class beside it, whose writes are whole when they return (a put is), and whose
`dcp_layer` names DCP's storage layer for it (torch's fsspec one: an entry in dcpwrite.DCP_LAYERS); a run uses
it by name (`--checkpoint-storage NAME`, entry point group `hpc_ddp.storages`). Every process builds its run's
storage once, with the folder, into a `store.CheckpointStore` that it hands to every reader: the trainer, the
resume, the supervisors, the doctor, the checkpoint tools. No parameter defaults to a storage
(tests/test_architecture.py): a reader that was not handed the run's would bypass it.

Paths are strings, as in torchtitan's CheckpointStorage: a URL (`s3://bucket/run/checkpoints/ckpt-00000120`)
survives them, where `pathlib.Path` would collapse its `//`.
"""

from __future__ import annotations

import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, ClassVar

from hpc_ddp.run.checkpoint import durable
from hpc_ddp.run.folder import atomic_write_bytes, fsync_dir


class Storage(ABC):
    """What the checkpoint formats and the store need. A write is whole and durable when it returns: a reader
    (a resume on another node, after a crash) sees the old state or the new one, never a part."""

    # Which of Distributed Checkpoint's storage layers writes and reads the sharded format's shards here
    # (hpc_ddp.run.checkpoint.dcpwrite.DCP_LAYERS; named, so that this module needs no torch).
    dcp_layer: ClassVar[str]

    # ----- writing ----------------------------------------------------------------------------------------
    @abstractmethod
    def write(self, path: str, fill: Callable[[BinaryIO], object]) -> int:
        """Let `fill` write file `path` (a temporary name until it is whole and durable), its SHA-256 beside it
        (`durable.checksum_path`); returns the bytes written. An OSError met on the way is what is raised."""

    @abstractmethod
    def write_bytes(self, path: str, data: bytes) -> None:
        """A small file (a pointer, a manifest), replaced atomically."""

    @abstractmethod
    def makedirs(self, path: str) -> None:
        """Directory `path` and its parents (nothing if it exists)."""

    @abstractmethod
    def install(self, temp: str, final: str) -> None:
        """Give the complete checkpoint directory `temp` its final name, durably; a checkpoint of the same name
        already there is replaced (never a rename onto an existing directory)."""

    @abstractmethod
    def remove(self, path: str) -> None:
        """Delete a file and its checksum, or a directory and everything in it (nothing if it is gone)."""

    @abstractmethod
    def rename(self, path: str, to: str) -> None:
        """Move file or directory `path` to `to`, replacing a file there."""

    # ----- reading ----------------------------------------------------------------------------------------
    @abstractmethod
    def isdir(self, path: str) -> bool: ...

    @abstractmethod
    def isfile(self, path: str) -> bool: ...

    @abstractmethod
    def listdir(self, path: str) -> list[str]:
        """The names directly under directory `path` (empty when it does not exist)."""

    @abstractmethod
    def read_bytes(self, path: str) -> bytes: ...

    @abstractmethod
    def open(self, path: str) -> BinaryIO:
        """File `path` for reading, seekable (torch reads a checkpoint's zip from it); the caller closes it."""

    @abstractmethod
    def size(self, path: str) -> int:
        """Bytes of a file, or of every file under a directory."""

    @abstractmethod
    def sha256(self, path: str) -> str:
        """The SHA-256 of file `path`'s bytes, read back."""


class Local(Storage):
    """This machine's filesystem: temporary names, fsync, rename, and the folder fsynced after a rename
    (hpc_ddp.ledger.files); checksums computed while writing (durable.write_summed)."""

    dcp_layer = "filesystem"

    def write(self, path: str, fill: Callable[[BinaryIO], object]) -> int:
        return durable.write_summed(Path(path), fill)  # type: ignore[arg-type]

    def write_bytes(self, path: str, data: bytes) -> None:
        atomic_write_bytes(Path(path), data)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def install(self, temp: str, final: str) -> None:
        # Never a rename onto an existing folder (which fails, ENOTEMPTY): the one there (the step saved again
        # with a later state: a run that finished right after a resume at its last step) is first moved aside
        # under a temporary name, which no listing shows and a start removes, then deleted.
        target = Path(final)
        aside = target.with_name(f".{target.name}.tmp-replaced-{os.getpid()}")
        replacing = target.exists()
        if replacing:
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(target, aside)
        os.replace(temp, target)
        fsync_dir(target.parent)
        if replacing:
            shutil.rmtree(aside, ignore_errors=True)

    def remove(self, path: str) -> None:
        target = Path(path)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)
        durable.checksum_path(target).unlink(missing_ok=True)

    def rename(self, path: str, to: str) -> None:
        os.replace(path, to)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path)

    def listdir(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def read_bytes(self, path: str) -> bytes:
        return Path(path).read_bytes()

    def open(self, path: str) -> BinaryIO:
        return open(path, "rb")  # noqa: SIM115  # the caller's to close

    def size(self, path: str) -> int:
        target = Path(path)
        if target.is_dir():
            return sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
        return target.stat().st_size

    def sha256(self, path: str) -> str:
        return durable.file_sha256(Path(path))
