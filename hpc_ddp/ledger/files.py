"""Atomic file writes: readers see the old file or the whole new one, never a part, whenever the writer dies.

Everything the ledger writes goes through these, and so do the run folder's other files (hpc_ddp.run.folder
re-exports them for the checkpoints, run.json and the rest).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (the directory entry, not only the file's data)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], object], sync_dir: bool = True) -> int:
    """Let `write` fill a temporary file next to `path`, make it durable, then rename it into place: readers
    see the old file or the whole new one, never a part, whenever the writer dies. Returns the file's size.
    Without `sync_dir` the caller fsyncs the folder itself (after renaming more files into it)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_dir(path.parent)
    return size


def atomic_write_bytes(path: Path, data: bytes | memoryview) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one, never a part."""
    atomic_write(path, lambda f: f.write(data))
