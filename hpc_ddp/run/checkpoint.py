"""Checkpoints on shared storage: atomic writes, a `latest` pointer, rotation, and safe loading.

Layout of `<folder>/checkpoints/` (the rest of the run folder: hpc_ddp.run.folder):

    ckpt-00000120.pt   one file per save, named by optimizer step
    latest             the name of the newest complete file, updated last

A save writes a temporary file in the same directory (same filesystem, so the rename is atomic), flushes and
fsyncs it, renames it into place, fsyncs the directory, and only then rewrites `latest` the same way. A crash
or SIGKILL at any instant leaves either the old or the new checkpoint complete, and never a promoted partial
file. Loading uses `weights_only=True`: a checkpoint is data and can never run code.

Integrity: each file's SHA-256 is computed while it is written (no second pass) and kept next to it in
`<name>.sha256`, in `sha256sum` format (`cd checkpoints && sha256sum -c ckpt-00000120.pt.sha256` checks it by
hand). A load re-reads the file and compares: a flipped bit is "corrupt" and the previous checkpoint is used.
"Corrupt" means exactly that (`CheckpointCorrupt`): the bytes differ from what was written, or the file is
torn. An intact file that a `weights_only` load refuses is `CheckpointRefused`, never called corrupt; and
`to_cpu` makes sure the kit never writes one (numpy scalars become Python numbers, anything else that such a
load would refuse fails the save at once, naming where it is).

`AsyncWriter` moves the slow part (serialisation and fsync) off the training thread: the caller snapshots the
state to CPU (a copy, so training can keep changing its tensors) and the writer thread makes it durable. A
write that fails with an OSError (full disk, quota, a file server hiccup) is reported at the caller's next
`check()` and retried with a doubling delay; only when it keeps failing does the caller have to stop.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import pickle
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from hpc_ddp.errors import CheckpointCorrupt, CheckpointError, CheckpointRefused, NonFinite
from hpc_ddp.run.folder import CHECKPOINTS, atomic_write, atomic_write_bytes, fsync_dir

LATEST = "latest"
_NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")
SUMS_SUFFIX = ".sha256"
_SUMS_LINE = re.compile(r"^([0-9a-f]{64}) [ *]")
SAVE_RETRIES = 5  # retries of a failed checkpoint write; the delays double from SAVE_BACKOFF_S (1+2+4+8+16 s)
SAVE_BACKOFF_S = float(os.environ.get("HPC_DDP_SAVE_BACKOFF_S") or 1.0)


def ckpt_dir(folder: str | os.PathLike[str]) -> Path:
    return Path(folder) / CHECKPOINTS


def ckpt_name(step: int) -> str:
    return f"ckpt-{step:08d}.pt"


def ckpt_step(path: Path) -> int:
    """The optimizer step in a checkpoint's file name (-1 for a file not named like one)."""
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else -1


def checksum_path(path: Path) -> Path:
    """Where the SHA-256 of `path` is kept: `<name>.sha256` next to it."""
    return path.with_name(path.name + SUMS_SUFFIX)


class _EarlyWriteback:
    """A file's write() that asks the kernel to start writing every few MB to disk as soon as they are
    written, so the disk works while the rest is still being serialised and the final fsync only waits for
    the tail (hpc_ddp.bench, 14 MB checkpoint: that fsync went from ~23 to ~18 ms)."""

    CHUNK = 4 << 20

    def __init__(self, f: BinaryIO, digest: Any = None) -> None:
        self.f, self.written, self.started = f, 0, 0
        self.digest = digest  # fed every byte on its way to the file (no second read): a _Sha256Pipe

    def write(self, data: Any) -> int:
        n = self.f.write(data)
        if self.digest is not None:
            self.digest.update(data)
        self.written += n
        if self.written - self.started >= self.CHUNK and hasattr(os, "posix_fadvise"):
            self.f.flush()
            # On dirty pages, DONTNEED starts their writeback and returns without waiting for it (Linux).
            os.posix_fadvise(
                self.f.fileno(), self.started, self.written - self.started, os.POSIX_FADV_DONTNEED
            )
            self.started = self.written
        return n

    def flush(self) -> None:
        self.f.flush()


_CRC_LOCK = threading.Lock()


def _save_stream(obj: Any, f: BinaryIO, digest: Any = None) -> None:
    """torch.save straight into the open temporary file, with no in-memory copy of the whole file first."""
    # Without zip CRC32s: torch.load never checks them (the file's SHA-256 is what load() verifies, see
    # atomic_save), and they cost ~6 ms per 14 MB, a sixth of a save (hpc_ddp.bench). The setting
    # is process-wide, hence the lock; a user's torch.save meanwhile in another thread also skips them,
    # harmlessly.
    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    with _CRC_LOCK:
        previous = get() if get else None
        if set_:
            set_(False)
        try:
            torch.save(obj, _EarlyWriteback(f, digest))  # type: ignore[arg-type]  # a file object: write(), flush()
        finally:
            if set_ and previous is not None:
                set_(previous)


def atomic_save(obj: Any, path: Path) -> int:
    """torch.save `obj` to `path` atomically, its SHA-256 (computed while writing) in `<path>.sha256`; returns
    the bytes written.

    The old checksum goes first, the new one is renamed in after the file and made durable by the same folder
    fsync: a crash in between leaves a file without a checksum (loaded unverified), never one with a wrong
    checksum. The small checksum file is not fsynced on its own (that would cost a second journal commit per
    save); after a crash it may be empty, which reads as "no checksum" too."""
    sums = checksum_path(path)
    sums.unlink(missing_ok=True)
    digest = _Sha256Pipe()
    try:
        size = atomic_write(path, lambda f: _save_stream(obj, f, digest), sync_dir=False)
    finally:
        hexdigest = digest.finish()
    try:
        _replace_unsynced(sums, f"{hexdigest}  {path.name}\n".encode())
    finally:
        fsync_dir(path.parent)
    return size


class _Sha256Pipe:
    """The SHA-256 of a byte stream, computed on a helper thread while the stream is still being written.

    SHA-256 runs at about the disk's speed (~1.6 GB/s with the CPU's SHA instructions, faster than zlib's
    crc32 here), so hashing in line would add about as much again to a save. Instead the writer copies each
    piece into one of a few chunk buffers (a memcpy) and goes on; the helper hashes full chunks in order
    (hashlib releases the GIL), alongside serialisation and the final fsync. Copying keeps it independent of
    how long the buffers torch hands to write() stay valid. `python -m hpc_ddp.bench checkpoint`, 3 x 20
    saves on this loaded 2-CPU machine: kit / raw 0.33-0.39 before, 0.35-0.37 with it (no visible change)."""

    CHUNK = 4 << 20
    SLOTS = 3  # at most this many chunks in memory; the writer waits for a free one if the helper lags

    def __init__(self) -> None:
        self._digest = hashlib.sha256()
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        for _ in range(self.SLOTS - 1):
            self._free.put(bytearray(self.CHUNK))
        self._full: queue.SimpleQueue[tuple[bytearray, int] | None] = queue.SimpleQueue()
        self._buffer, self._used = bytearray(self.CHUNK), 0
        self._thread = threading.Thread(target=self._hash, name="hpc_ddp-ckpt-sha256", daemon=True)
        self._thread.start()

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = min(len(view), self.CHUNK - self._used)
            self._buffer[self._used : self._used + n] = view[:n]
            self._used += n
            view = view[n:]
            if self._used == self.CHUNK:
                self._full.put((self._buffer, self._used))
                self._buffer, self._used = self._free.get(), 0

    def _hash(self) -> None:
        while (item := self._full.get()) is not None:
            buffer, used = item
            self._digest.update(memoryview(buffer)[:used])
            self._free.put(buffer)

    def finish(self) -> str:
        """The hex digest of everything given; ends the helper (call it on every path)."""
        if self._used:
            self._full.put((self._buffer, self._used))
            self._used = 0
        self._full.put(None)
        self._thread.join()
        return self._digest.hexdigest()


def _replace_unsynced(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def recorded_checksum(path: Path) -> str | None:
    """The SHA-256 recorded when `path` was written, or None (no `.sha256` file, or an unreadable one)."""
    try:
        match = _SUMS_LINE.match(checksum_path(path).read_text(encoding="ascii", errors="replace"))
    except OSError:
        return None
    return match.group(1) if match else None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(4 << 20)
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def remove(path: Path) -> None:
    """Delete a checkpoint file and its checksum."""
    path.unlink(missing_ok=True)
    checksum_path(path).unlink(missing_ok=True)


def to_cpu(obj: Any, what: str = "the state") -> Any:
    """A deep copy of a (nested) state with every tensor on CPU, safe to write while training goes on, made
    only of what a `weights_only` load accepts: numpy scalars become Python numbers (an optimizer built with
    `lr=np.float64(...)` used to save checkpoints that never loaded); anything else such a load would refuse
    raises CheckpointError naming where it is, before a byte is written."""
    try:
        return _copy(obj)
    except _Unsavable as e:
        raise CheckpointError(e.message(what)) from None


def check_savable(obj: Any, what: str) -> None:
    """What `to_cpu` would refuse, found without copying a tensor: every rank calls it before training, so
    that a state that could never be loaded back is a usage error at start, not a failed save later."""
    try:
        _walk(obj)
    except _Unsavable as e:
        raise CheckpointError(e.message(what)) from None


class _Unsavable(Exception):
    def __init__(self, value: Any) -> None:
        self.value, self.where = value, []  # keys from the inside out

    def message(self, what: str) -> str:
        where = what + "".join(f"[{k!r}]" for k in reversed(self.where))
        kind = type(self.value)
        return (
            f"{where} is a {kind.__module__}.{kind.__qualname__} ({repr(self.value)[:60]}), which a "
            "checkpoint cannot hold: torch.load(weights_only=True) refuses it, so the checkpoint could never "
            "be resumed. Fix: keep plain Python numbers, strings, lists, dicts and torch tensors in the "
            "model's and optimizer's state (or register the type with torch.serialization.add_safe_globals "
            "in your task module)"
        )


def _copy(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if type(obj) in _SCALARS:
        return obj
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            try:
                out[k if type(k) in _SCALARS else _leaf(k)] = _copy(v)
            except _Unsavable as e:
                e.where.append(k)
                raise
        return out
    if type(obj) in (list, tuple, torch.Size):
        if set(map(type, obj)) <= _SCALARS:
            # Copied whole, at C speed: walking each rank's 625-int Python RNG state item by item cost
            # ~0.25 ms per rank on every save, on the training thread (hpc_ddp.bench).
            return type(obj)(obj)
        return type(obj)(_copy_items(obj))
    if type(obj) is set:
        return set(_copy_items(obj))
    return _leaf(obj)


def _copy_items(items: Iterable[Any]) -> Iterable[Any]:
    for i, v in enumerate(items):
        try:
            yield _copy(v)
        except _Unsavable as e:
            e.where.append(i)
            raise


def _walk(obj: Any) -> None:
    if isinstance(obj, torch.Tensor) or type(obj) in _SCALARS:
        return
    if isinstance(obj, dict):
        pairs: Iterable[tuple[Any, Any]] = obj.items()
    elif type(obj) in (list, tuple, torch.Size, set):
        pairs = enumerate(obj)
    else:
        _leaf(obj)
        return
    for k, v in pairs:
        try:
            if isinstance(obj, dict) and type(k) not in _SCALARS:
                _leaf(k)
            _walk(v)
        except _Unsavable as e:
            e.where.append(k)
            raise


def _leaf(obj: Any) -> Any:
    """A value that is no container and no tensor, as it can be saved: numpy scalars (and 0-d arrays) as the
    Python number they hold; other types only if a weights_only load accepts them."""
    kind = type(obj)
    if kind.__module__ == "numpy" and getattr(obj, "ndim", None) == 0 and hasattr(obj, "item"):
        return obj.item()
    if (
        kind is complex
        or isinstance(obj, (torch.dtype, torch.device))
        or _qualname(kind) in _loadable_globals()
    ):
        return obj
    raise _Unsavable(obj)


def _qualname(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _loadable_globals() -> set[str]:
    """Types a weights_only load rebuilds: torch's own list and whatever the user registered as safe."""
    names: set[str] = set()
    try:
        from torch import _weights_only_unpickler

        names.update(_weights_only_unpickler._get_allowed_globals())
    except (ImportError, AttributeError):
        pass
    for entry in getattr(torch.serialization, "get_safe_globals", list)():
        target = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(target, type):
            names.add(_qualname(target))
    return names


_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})


def require_finite(model_state: dict[str, Any], names: Iterable[str], step: int) -> None:
    """Refuse to write weights that are NaN or infinite (an update that overflowed): the checkpoint would
    replace a good one. Only `names` (the parameters) are checked: buffers may hold -inf on purpose (masks)."""
    bad = [
        n
        for n in names
        if isinstance(model_state.get(n), torch.Tensor)
        and model_state[n].is_floating_point()
        and not bool(torch.isfinite(model_state[n]).all())
    ]
    if bad:
        raise NonFinite(
            f"the weights at step {step} are not finite ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}): the update before it overflowed. That checkpoint was "
            "not written, and the earlier ones are kept. Fix: a smaller --lr (or --clip-grad), then "
            "run the same command to resume from the last good checkpoint"
        )


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
    stale = (
        [p for p in directory.iterdir() if p.name.startswith(".") and ".tmp-" in p.name]
        if directory.is_dir()
        else []
    )
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


def read_latest(folder: str | os.PathLike[str], warn: Callable[[str], None] | None = None) -> Path | None:
    """The file `latest` points to, if the pointer exists and names an existing file. A pointer that cannot be
    read (not UTF-8, a directory, an I/O error) counts as none; `warn` hears about it."""
    pointer = ckpt_dir(folder) / LATEST
    try:
        text = pointer.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # IsADirectoryError, UnicodeDecodeError, EIO...
        if warn is not None:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
            warn(f"{pointer} is unreadable ({reason}); using the newest checkpoint that loads instead")
        return None
    name = text.strip()
    path = ckpt_dir(folder) / name
    if _NAME.match(name) and path.is_file():
        return path
    if warn is not None and name:
        warn(
            f"{pointer} names {name[:80]!r}, which is not a checkpoint of this folder; using the newest "
            "checkpoint that loads instead"
        )
    return None


def commit(
    folder: str | os.PathLike[str],
    state: dict[str, Any],
    step: int,
    keep: int,
    save: Callable[[Any, Path], int] = atomic_save,
) -> tuple[Path, int]:
    """Write checkpoint `step` with `save` (durable, renamed into place, when it returns), point `latest` at
    it, then drop all but the newest `keep` of its line. Returns the checkpoint's path and size.

    Rotation keeps this file and the `keep - 1` newest before it. It never deletes a file with a higher step:
    such a file is no part of the line this run continues (a start from an earlier checkpoint sets those
    aside first, `resume.apply`), and deleting by step number alone once deleted the file just written."""
    directory = ckpt_dir(folder)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ckpt_name(step)
    nbytes = save(state, path)
    atomic_write_bytes(directory / LATEST, (path.name + "\n").encode())
    for old in [p for p in list_checkpoints(folder) if ckpt_step(p) < step][keep - 1 :]:
        remove(old)
    return path, nbytes


# How a Trainer makes a checkpoint durable: commit(folder, state, step, keep) -> (path, bytes). `commit` above
# unless the Trainer is given another (the bench passes `commit` with a timed `save`).
Commit = Callable[[Path, dict[str, Any], int, int], tuple[Path, int]]


# Globals that numpy scalars pickle as: data only (a dtype and raw bytes). Checkpoints written before the kit
# converted numpy scalars hold them (an optimizer built with lr=np.float64); they load with these allowed.
_NUMPY_SCALAR_GLOBALS = re.compile(r"^numpy(\._core|\.core)?\.(multiarray\.scalar|dtype|dtypes\.\w+DType)$")


def load(path: str | os.PathLike[str], map_location: Any = "cpu", verify: bool = True) -> dict[str, Any]:
    """Load a checkpoint as data only (`weights_only=True`) after checking its SHA-256 against the one
    recorded when it was written (`verify`, when there is one). CheckpointCorrupt if its bytes are damaged,
    CheckpointRefused if it is intact but holds what such a load refuses, CheckpointError if it is no
    hpc_ddp checkpoint."""
    path = Path(path)
    expected = recorded_checksum(path) if verify else None
    if expected is not None:
        try:
            actual = file_sha256(path)
        except OSError as e:
            raise CheckpointCorrupt(
                f"checkpoint {path} cannot be loaded safely: it cannot be read ({e.strerror or e})"
            ) from e
        if actual != expected:
            raise CheckpointCorrupt(
                f"checkpoint {path} cannot be loaded safely: it is corrupt (its SHA-256 is "
                f"{actual[:16]}..., {checksum_path(path).name} recorded {expected[:16]}... "
                "when it was written)"
            )
    try:
        state = _load_weights_only(path, map_location)
    except CheckpointError:
        raise
    except Exception as e:  # a torn zip, a damaged pickle
        raise CheckpointCorrupt(
            f"checkpoint {path} cannot be loaded safely: it is corrupt "
            f"({str(e).splitlines()[0][:300] if str(e) else type(e).__name__})"
        ) from e
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"checkpoint {path} is not an hpc_ddp checkpoint (no 'model' entry)")
    return state


def _load_weights_only(path: Path, map_location: Any) -> Any:
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only" not in str(e).lower():
            raise
        refused = _refused_globals(path, str(e))
    if refused and all(_NUMPY_SCALAR_GLOBALS.match(name) for name in refused):
        with torch.serialization.safe_globals([_resolve(name) for name in refused] + _numpy_dtype_classes()):
            return torch.load(path, map_location=map_location, weights_only=True)
    names = ", ".join(refused) or "objects"
    raise CheckpointRefused(
        f"checkpoint {path} cannot be loaded safely: it is intact, but holds {names}, which a "
        "weights_only load refuses (unpickling them could run code). Fix: resume from "
        "another checkpoint (--resume PATH), or another --folder; load it yourself only if "
        "you trust where it came from"
    )


def _refused_globals(path: Path, message: str) -> list[str]:
    finder = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if finder is not None:
        try:
            return sorted(finder(path))
        except Exception:  # a damaged file: say what the error said
            pass
    return sorted(set(re.findall(r"GLOBAL ([\w.]+)", message)))


def _numpy_dtype_classes() -> list[type]:
    """numpy's dtype classes (numpy.dtypes.Float64DType...), which a pickled dtype is rebuilt as (numpy 1.25+)."""
    dtypes = getattr(sys.modules.get("numpy"), "dtypes", None)
    return [getattr(dtypes, name) for name in dir(dtypes) if name.endswith("DType")] if dtypes else []


def _resolve(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def find_resumable(
    folder: str | os.PathLike[str], warn: Callable[[str], None]
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of `folder` that loads, starting at `latest`; each bad one is reported and skipped.
    An unreadable `latest` is reported and the checkpoints are tried newest first."""
    candidates = list_checkpoints(folder)
    latest = read_latest(folder, warn)
    if latest is not None:
        candidates = [latest] + [p for p in candidates if p != latest]
    for path in candidates:
        try:
            return path, load(path)
        except CheckpointError as e:
            warn(f"{e}; trying the previous checkpoint")
    return None


def retriable(error: BaseException) -> bool:
    """A write error that may go away by itself: a full disk or quota, a file server's hiccup (OSError), but
    not a path that is a file where a folder must be, nor a permission denied."""
    return isinstance(error, OSError) and not isinstance(
        error, (FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)
    )


class AsyncWriter:
    """One background thread that makes checkpoints durable while training continues.

    At most one write is in flight: `submit` first waits for the previous one, so a slow filesystem applies
    back-pressure instead of queueing copies of the model in memory.

    A failed write is not left for the next save to find: `check()`, called by the training loop every step,
    books it, says so through `warn`, and retries it after 1, 2, 4... s (SAVE_BACKOFF_S doubling) while training
    goes on. A newer save supersedes a pending retry. After SAVE_RETRIES failed retries, or at once for an error
    that no retry cures, `check()` returns the error: the run must stop.
    """

    def __init__(
        self,
        warn: Callable[[str], None] | None = None,
        retries: int = SAVE_RETRIES,
        backoff_s: float | None = None,
    ) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last: tuple[Path, int] | None = None
        self.warn = warn or _warn_stderr
        self.retries = retries
        self.backoff_s = SAVE_BACKOFF_S if backoff_s is None else backoff_s
        self.failures = 0  # consecutive failed attempts
        self.fatal: BaseException | None = None  # saving keeps failing: whoever checks must stop
        self._job: Callable[[], tuple[Path, int]] | None = (
            None  # the newest state's write, until it is durable
        )
        self._failed: BaseException | None = None  # the last failure, while a retry of it is pending
        self._retry_at: float | None = None

    def _start(self, job: Callable[[], tuple[Path, int]]) -> None:
        def run() -> None:
            try:
                self.last = job()
            except BaseException as e:  # booked on the training thread by check() or wait()
                self._error = e

        self._thread = threading.Thread(target=run, name="hpc_ddp-ckpt-writer", daemon=False)
        self._thread.start()

    def _collect(self, block: bool) -> None:
        """Book the outcome of the write in flight once it ended (with `block`, wait for it to end)."""
        thread = self._thread
        if thread is None or (not block and thread.is_alive()):
            return
        thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is None:
            if self.failures and self.last is not None:
                self.warn(f"checkpoint {self.last[0]} written after {self.failures} failed attempt(s)")
            self.failures, self._job, self._failed, self._retry_at = 0, None, None, None
            return
        self.failures += 1
        self._failed = error
        if not retriable(error) or self.failures > self.retries:
            self.fatal, self._retry_at = error, None
            return
        delay = self.backoff_s * 2 ** (self.failures - 1)
        self._retry_at = time.monotonic() + delay
        self.warn(
            f"a checkpoint could not be written ({describe(error)}); retry {self.failures} of {self.retries} "
            f"in {delay:g} s, training goes on"
        )

    def check(self) -> BaseException | None:
        """Non-blocking, every step: book a write that ended, start a retry that is due. The error that must
        stop the run, once saving keeps failing; else None."""
        self._collect(block=False)
        if (
            self.fatal is None
            and self._retry_at is not None
            and self._job is not None
            and self._thread is None
            and time.monotonic() >= self._retry_at
        ):
            self._retry_at = None
            self._start(self._job)
        return self.fatal

    def submit(self, job: Callable[[], tuple[Path, int]]) -> None:
        """Write in the background (after the write in flight). Once saving has failed for good nothing more
        is started: `check()` (every step) or `wait()` reports it, on every rank at the same step."""
        self._collect(block=True)
        if self.fatal is not None:
            return
        self._retry_at = None  # a failed older write is superseded: this state is newer
        self._job = job
        self._start(job)

    def wait(self, retry: bool = False) -> tuple[Path, int] | None:
        """Block until the write in flight is durable; re-raise its error, if any. With `retry`, a failed write
        is retried (sleeping the backoff) until it is written or the retries are spent."""
        while True:
            self._collect(block=True)
            if self.fatal is not None:
                raise self.fatal
            if self._retry_at is None or self._job is None:
                return self.last
            if not retry:
                assert self._failed is not None
                raise self._failed
            time.sleep(max(0.0, self._retry_at - time.monotonic()))
            self._retry_at = None
            self._start(self._job)


def describe(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror}: {error.filename}" if error.filename else error.strerror
    return f"{type(error).__name__}: {error}"


def _warn_stderr(message: str) -> None:
    sys.stderr.write(f"warning: {message}\n")
    sys.stderr.flush()
