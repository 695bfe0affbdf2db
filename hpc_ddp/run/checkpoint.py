"""Checkpoints on shared storage: atomic writes, a `latest` pointer, rotation, and safe loading.

Layout of `<folder>/checkpoints/` (the rest of the run folder: hpc_ddp.run.folder):

    ckpt-00000120.pt   one file per save, named by optimizer step
    latest             the name of the newest complete file, updated last

A save writes a temporary file in the same directory (same filesystem, so the rename is atomic), flushes and
fsyncs it, renames it into place, fsyncs the directory, and only then rewrites `latest` the same way. A crash
or SIGKILL at any instant leaves either the old or the new checkpoint complete, and never a promoted partial
file. Loading uses `weights_only=True`: a checkpoint is data and can never run code.

`AsyncWriter` moves the slow part (serialisation and fsync) off the training thread: the caller snapshots the
state to CPU (a copy, so training can keep changing its tensors) and the writer thread makes it durable.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from hpc_ddp.errors import CheckpointError
from hpc_ddp.run.folder import CHECKPOINTS, atomic_write, atomic_write_bytes

LATEST = "latest"
_NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")


def ckpt_dir(folder: str | os.PathLike[str]) -> Path:
    return Path(folder) / CHECKPOINTS


def ckpt_name(step: int) -> str:
    return f"ckpt-{step:08d}.pt"


class _EarlyWriteback:
    """A file's write() that asks the kernel to start writing every few MB to disk as soon as they are
    written, so the disk works while the rest is still being serialised and the final fsync only waits for
    the tail (hpc_ddp.bench, 14 MB checkpoint: that fsync went from ~23 to ~18 ms)."""

    CHUNK = 4 << 20

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.written, self.started = f, 0, 0

    def write(self, data: Any) -> int:
        n = self.f.write(data)
        self.written += n
        if self.written - self.started >= self.CHUNK and hasattr(os, "posix_fadvise"):
            self.f.flush()
            # On dirty pages, DONTNEED starts their writeback and returns without waiting for it (Linux).
            os.posix_fadvise(self.f.fileno(), self.started, self.written - self.started,
                             os.POSIX_FADV_DONTNEED)
            self.started = self.written
        return n

    def flush(self) -> None:
        self.f.flush()


_CRC_LOCK = threading.Lock()


def _save_stream(obj: Any, f: BinaryIO) -> None:
    """torch.save straight into the open temporary file, with no in-memory copy of the whole file first."""
    # Without zip CRC32s: torch.load never checks them (a torn file is caught by the zip directory; the atomic
    # rename keeps files whole), and they cost ~6 ms per 14 MB, a sixth of a save (hpc_ddp.bench). The setting
    # is process-wide, hence the lock; a user's torch.save meanwhile in another thread also skips them,
    # harmlessly.
    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    with _CRC_LOCK:
        previous = get() if get else None
        if set_:
            set_(False)
        try:
            torch.save(obj, _EarlyWriteback(f))  # type: ignore[arg-type]  # a file object: write(), flush()
        finally:
            if set_ and previous is not None:
                set_(previous)


def atomic_save(obj: Any, path: Path) -> int:
    """torch.save `obj` to `path` atomically; returns the bytes written."""
    return atomic_write(path, lambda f: _save_stream(obj, f))


def to_cpu(obj: Any) -> Any:
    """A deep copy of a (nested) state with every tensor on CPU, safe to write while training goes on."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        if set(map(type, obj)) <= _SCALARS:
            # Copied whole, at C speed: walking each rank's 625-int Python RNG state item by item cost
            # ~0.25 ms per rank on every save, on the training thread (hpc_ddp.bench).
            return type(obj)(obj)
        return type(obj)(to_cpu(v) for v in obj)
    return obj


_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})


def list_checkpoints(folder: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoint files of a run, newest (highest step) first. Temporary files are never listed."""
    directory = ckpt_dir(folder)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def remove_stale_temporaries(folder: str | os.PathLike[str]) -> int:
    """Delete temporary files a killed writer left behind (called by rank 0 at start, before any new save)."""
    directory = ckpt_dir(folder)
    stale = [p for p in directory.iterdir() if p.name.startswith(".") and ".tmp-" in p.name] \
        if directory.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


def read_latest(folder: str | os.PathLike[str]) -> Path | None:
    """The file `latest` points to, if the pointer exists and names an existing file."""
    pointer = ckpt_dir(folder) / LATEST
    try:
        name = pointer.read_text().strip()
    except FileNotFoundError:
        return None
    path = ckpt_dir(folder) / name
    return path if _NAME.match(name) and path.is_file() else None


def commit(folder: str | os.PathLike[str], state: dict[str, Any], step: int, keep: int,
           save: Callable[[Any, Path], int] = atomic_save) -> tuple[Path, int]:
    """Write checkpoint `step` with `save` (durable, renamed into place, when it returns), point `latest` at
    it, then drop all but the newest `keep`. Returns the checkpoint's path and size."""
    directory = ckpt_dir(folder)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ckpt_name(step)
    nbytes = save(state, path)
    atomic_write_bytes(directory / LATEST, (path.name + "\n").encode())
    for old in list_checkpoints(folder)[keep:]:
        old.unlink(missing_ok=True)
    return path, nbytes


# How a Trainer makes a checkpoint durable: commit(folder, state, step, keep) -> (path, bytes). `commit` above
# unless the Trainer is given another (the bench passes `commit` with a timed `save`).
Commit = Callable[[Path, dict[str, Any], int, int], tuple[Path, int]]


def load(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any]:
    """Load a checkpoint as data only (`weights_only=True`); CheckpointError if it is unreadable."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated zip, bad pickle, or a pickle that would run code
        raise CheckpointError(f"checkpoint {path} cannot be loaded safely: {str(e).splitlines()[0][:300]}") from e
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"checkpoint {path} is not an hpc_ddp checkpoint (no 'model' entry)")
    return state


def find_resumable(folder: str | os.PathLike[str], warn: Callable[[str], None]) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of `folder` that loads, starting at `latest`; each bad one is reported and skipped."""
    candidates = list_checkpoints(folder)
    latest = read_latest(folder)
    if latest is not None:
        candidates = [latest] + [p for p in candidates if p != latest]
    for path in candidates:
        try:
            return path, load(path)
        except CheckpointError as e:
            warn(f"{e}; trying the previous checkpoint")
    return None


class AsyncWriter:
    """One background thread that makes checkpoints durable while training continues.

    At most one write is in flight: `submit` first waits for the previous one, so a slow filesystem applies
    back-pressure instead of queueing copies of the model in memory.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last: tuple[Path, int] | None = None

    def submit(self, job: Callable[[], tuple[Path, int]]) -> None:
        self.wait()

        def run() -> None:
            try:
                self.last = job()
            except BaseException as e:  # surfaced on the training thread by wait()
                self._error = e

        self._thread = threading.Thread(target=run, name="hpc_ddp-ckpt-writer", daemon=False)
        self._thread.start()

    def wait(self) -> tuple[Path, int] | None:
        """Block until the write in flight is durable; re-raise its error, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.last
