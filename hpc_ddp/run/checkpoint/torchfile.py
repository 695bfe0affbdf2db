"""One torch file: `torch.save` streamed into a durable, checksummed file, and loaded back as data only.

Loading uses `weights_only=True`: a checkpoint is data and can never run code. What a load finds is said
exactly: CheckpointCorrupt when the bytes are damaged (checksum, torn zip), CheckpointRefused when the file is
intact but holds objects such a load refuses; checkpoints written before the kit converted numpy scalars still
load (their numpy globals are data only).
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.errors import CheckpointCorrupt, CheckpointError, CheckpointRefused
from hpc_ddp.run.checkpoint import durable
from hpc_ddp.run.checkpoint.storage import Storage

_CRC_LOCK = threading.Lock()


def _save_stream(obj: Any, out: durable.Writeback) -> None:
    """torch.save straight into the open temporary file, with no in-memory copy of the whole file first."""
    # Without zip CRC32s: torch.load never checks them (the file's SHA-256 is what load_file() verifies), and
    # they cost ~6 ms per 14 MB, a sixth of a save (hpc_ddp.bench). The setting is process-wide, hence the
    # lock; a user's torch.save meanwhile in another thread also skips them, harmlessly.
    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    with _CRC_LOCK:
        previous = get() if get else None
        if set_:
            set_(False)
        try:
            torch.save(obj, out)  # type: ignore[arg-type]  # a file object: write(), flush()
        finally:
            if set_ and previous is not None:
                set_(previous)


def atomic_save(obj: Any, path: Path, storage: Storage) -> int:
    """torch.save `obj` to `path` atomically, its SHA-256 in `<path>.sha256` (Storage.write; locally:
    durable.write_summed); returns the bytes written."""
    return storage.write(str(path), lambda out: _save_stream(obj, out))  # type: ignore[arg-type]


def load_file(
    path: str | os.PathLike[str], storage: Storage, map_location: Any = "cpu", verify: bool = True
) -> Any:
    """Load a torch file from `storage` as data only (`weights_only=True`) after checking its SHA-256 against the
    one recorded when it was written (`verify`, when there is one). CheckpointCorrupt if its bytes are damaged,
    CheckpointRefused if it is intact but holds what such a load refuses."""
    path = Path(path)
    if verify:
        check_sums(path, storage)
    try:
        return _load_weights_only(path, storage, map_location)
    except CheckpointError:
        raise
    except Exception as e:  # a torn zip, a damaged pickle
        raise CheckpointCorrupt(
            f"checkpoint {path} cannot be loaded safely: it is corrupt "
            f"({str(e).splitlines()[0][:300] if str(e) else type(e).__name__})"
        ) from e


def _torch_load(path: Path, storage: Storage, map_location: Any) -> Any:
    with storage.open(str(path)) as f:  # a stream of the storage's: torch reads the zip through it
        return torch.load(f, map_location=map_location, weights_only=True)


def recorded_checksum(path: Path, storage: Storage) -> str | None:
    """The SHA-256 recorded when `path` was written, or None (no `.sha256` file, or an unreadable one)."""
    try:
        text = storage.read_bytes(str(durable.checksum_path(path))).decode("ascii", errors="replace")
    except OSError:
        return None
    match = durable.SUMS_LINE.match(text)
    return match.group(1) if match else None


def check_sums(path: Path, storage: Storage) -> None:
    """CheckpointCorrupt unless `path`'s bytes in `storage` are the ones recorded when it was written (a file
    without a recorded checksum passes: written by an older kit, or its checksum cut by a crash)."""
    expected = recorded_checksum(path, storage)
    if expected is None:
        return
    try:
        actual = storage.sha256(str(path))
    except OSError as e:
        raise CheckpointCorrupt(
            f"checkpoint {path} cannot be loaded safely: it cannot be read ({e.strerror or e})"
        ) from e
    if actual != expected:
        raise CheckpointCorrupt(
            f"checkpoint {path} cannot be loaded safely: it is corrupt (its SHA-256 is "
            f"{actual[:16]}..., {durable.checksum_path(path).name} recorded {expected[:16]}... "
            "when it was written)"
        )


# Globals that numpy scalars pickle as: data only (a dtype and raw bytes). Checkpoints written before the kit
# converted numpy scalars hold them (an optimizer built with lr=np.float64); they load with these allowed.
_NUMPY_SCALAR_GLOBALS = re.compile(r"^numpy(\._core|\.core)?\.(multiarray\.scalar|dtype|dtypes\.\w+DType)$")


def _load_weights_only(path: Path, storage: Storage, map_location: Any) -> Any:
    try:
        return _torch_load(path, storage, map_location)
    except pickle.UnpicklingError as e:
        if "weights only" not in str(e).lower():
            raise
        refused = _refused_globals(path, storage, str(e))
    if refused and all(_NUMPY_SCALAR_GLOBALS.match(name) for name in refused):
        with torch.serialization.safe_globals([_resolve(name) for name in refused] + _numpy_dtype_classes()):
            return _torch_load(path, storage, map_location)
    names = ", ".join(refused) or "objects"
    raise CheckpointRefused(
        f"checkpoint {path} cannot be loaded safely: it is intact, but holds {names}, which a "
        "weights_only load refuses (unpickling them could run code). Fix: resume from "
        "another checkpoint (--resume PATH), or another --folder; load it yourself only if "
        "you trust where it came from"
    )


def _refused_globals(path: Path, storage: Storage, message: str) -> list[str]:
    finder = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if finder is not None:
        try:
            with storage.open(str(path)) as f:
                return sorted(finder(f))
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
