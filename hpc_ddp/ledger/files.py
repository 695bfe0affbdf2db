"""Atomic file writes: readers see the old file or the whole new one, never a part, whenever the writer dies.

Everything the ledger writes goes through these, and so do the run folder's other files (hpc_ddp.run.folder
re-exports them for the checkpoints, run.json and the rest).

A full disk (ENOSPC, or a quota: EDQUOT) is a state that passes: a job beside this one frees space, a user
deletes old checkpoints. Every write of the kit survives it for the retry window, the checkpoint writer's
(1 + 2 + 4 + 8 + 16 = 31 s from $HPC_DDP_SAVE_BACKOFF_S's first delay, 1 s): a write that happens once (run.json,
the lock, model.pth, a ledger record) is retried that long (`patiently`); a stream of them (metrics.jsonl, the
logs, TensorBoard) is held in memory and written once there is space. Only then is the disk a failure, and
never a usage error: the same command works once there is space.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO, TypeVar

from hpc_ddp.variables import SAVE_BACKOFF_S

T = TypeVar("T")
FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
RETRIES = 5  # the checkpoint writer's retries: 1, 2, 4, 8 and 16 s (doubling from the first delay)


def is_full(error: BaseException) -> bool:
    """A write failed because the disk (or the quota) is full: it may work once there is space."""
    return isinstance(error, OSError) and error.errno in FULL


def backoff_s(environ: Mapping[str, str] | None = None) -> float:
    """The first retry delay: $HPC_DDP_SAVE_BACKOFF_S, read now (default 1 s)."""
    text = (os.environ if environ is None else environ).get(SAVE_BACKOFF_S) or ""
    try:
        value = float(text) if text else 1.0
    except ValueError:
        value = 1.0
    return value if value > 0 else 1.0


def window_s(environ: Mapping[str, str] | None = None) -> float:
    """How long a full disk is waited out: the sum of the checkpoint writer's retry delays."""
    return backoff_s(environ) * (2**RETRIES - 1)


def patiently(
    write: Callable[[], T],
    what: str,
    warn: Callable[[str], None] | None = None,
    window: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`write()`, retried while it fails because the disk is full, for up to the retry window (`window_s`); any
    other error at once. `warn` hears once that it waits, naming `what`. The last error is raised after."""
    limit = window_s() if window is None else window
    began, delay = clock(), 0.25
    while True:
        try:
            return write()
        except OSError as e:
            waited = clock() - began
            if not is_full(e) or waited >= limit:
                raise
            if warn is not None and delay == 0.25:
                warn(
                    f"cannot write {what} ({e.strerror or e}); retrying for up to {limit:g} s until there is "
                    "space"
                )
            sleep(min(delay, max(0.0, limit - waited)))
            delay = min(delay * 2, 2.0)


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
