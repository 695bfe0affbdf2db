"""Checkpoints on shared storage: atomic writes, a `latest` pointer, rotation, and safe loading.

Layout of a run folder:

    <folder>/checkpoints/ckpt-00000120.pt   one file per save, named by optimizer step
    <folder>/checkpoints/latest             the name of the newest complete file, updated last
    <folder>/model.pth                      the final weights, a plain state dict

A save writes a temporary file in the same directory (same filesystem, so the rename is atomic), flushes and
fsyncs it, renames it into place, fsyncs the directory, and only then rewrites `latest` the same way. A crash
or SIGKILL at any instant leaves either the old or the new checkpoint complete, and never a promoted partial
file. Loading uses `weights_only=True`: a checkpoint is data and can never run code.

`AsyncWriter` moves the slow part (serialisation and fsync) off the training thread: the caller snapshots the
state to CPU (a copy, so training can keep changing its tensors) and the writer thread makes it durable.
"""

from __future__ import annotations

import io
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.errors import CheckpointError

CKPT_DIR = "checkpoints"
LATEST = "latest"
_NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")


def ckpt_dir(folder: str | os.PathLike[str]) -> Path:
    return Path(folder) / CKPT_DIR


def ckpt_name(step: int) -> str:
    return f"ckpt-{step:08d}.pt"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes | memoryview) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_save(obj: Any, path: Path) -> int:
    """torch.save `obj` to `path` atomically; returns the bytes written."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    view = buf.getbuffer()
    atomic_write_bytes(path, view)
    return view.nbytes


def to_cpu(obj: Any) -> Any:
    """A deep copy of a (nested) state with every tensor on CPU, safe to write while training goes on."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


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


def commit(folder: str | os.PathLike[str], state: dict[str, Any], step: int, keep: int) -> tuple[Path, int]:
    """Write checkpoint `step`, point `latest` at it, then drop all but the newest `keep`."""
    directory = ckpt_dir(folder)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ckpt_name(step)
    nbytes = atomic_save(state, path)
    atomic_write_bytes(directory / LATEST, (path.name + "\n").encode())
    for old in list_checkpoints(folder)[keep:]:
        old.unlink(missing_ok=True)
    return path, nbytes


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
