"""What each rank ended with, for its supervisor: `<folder>/exits/<job>-<restart>/rank<N>.json`.

A rank that leaves on an exception writes one small note before it goes: its node, the time, the exception's
type, message and traceback, and the error's signature (hpc_ddp.ledger.signature). The supervisor (the local
launcher, or the batch shell after srun returns) reads the notes of the attempt that just ended to tell the
error that started it from the errors it caused on the other ranks (a peer that vanished), to blame a node
for a hardware error, and to show the first error's traceback once. A rank killed by a signal writes nothing:
its supervisor sees the signal instead. No torch.

A full disk must not lose a note: the supervisor would name another rank's consequence as the first cause, and
retry what cannot succeed (checkpoints that cannot be written). Waiting for space is no answer here: a rank on
its way out is stopped by its supervisor as soon as a peer has left. So each rank sets its note's space aside
when its attempt starts training (`reserve`: a placeholder file the readers skip), and a note that cannot be
written anew on a full disk is written over that placeholder in place, on blocks the file already holds.
A rank that knows its node (`Slot`: the kit's own ranks) shares one such file with its node's ranks,
`node<N>.space`, a NOTE_BYTES slot each, written by the node's local rank 0: one file created per node at an
attempt's start instead of one per rank (8,000 creates at once on a parallel file system's metadata server at
1,000 nodes x 8 GPUs, docs/scale.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

from hpc_ddp.errors import RunStopped, UsageError
from hpc_ddp.ledger.files import atomic_write_bytes, is_full
from hpc_ddp.ledger.signature import signature

EXITS = "exits"
NOTE_BYTES = 32 * 1024  # the space set aside for a note; a longer traceback is cut (its end is kept) to fit
_PLACEHOLDER = b'{"reserved": true}'  # a note's space, set aside: not a note (no "rank")
SPACE = "node{}.space"  # a node's ranks' note space, a slot of NOTE_BYTES per local rank
Slot = tuple[int, int, int]  # (node rank, local rank, ranks on that node): where a rank's space is


def attempt_folder(folder: Path, job: str, restart: int) -> Path:
    return Path(folder) / EXITS / f"{job}-{restart}"


def _path(folder: Path, job: str, restart: int, rank: int) -> Path:
    return attempt_folder(folder, job, restart) / f"rank{rank}.json"


def _space(folder: Path, job: str, restart: int, node: int) -> Path:
    return attempt_folder(folder, job, restart) / SPACE.format(node)


def reserve(folder: Path, job: str, restart: int, rank: int, slot: Slot | None = None) -> None:
    """Set aside the space of this rank's note for this attempt (never raises: without it the note is written
    as before, unless the disk is full then). With its `slot`: its node's file, by the node's local rank 0."""
    if slot is not None:
        node, local, count = slot
        if local == 0:
            path = _space(folder, job, restart, node)
            with contextlib.suppress(OSError):
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(path, _PLACEHOLDER.ljust(NOTE_BYTES) * max(1, count))
        return
    path = _path(folder, job, restart, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, _PLACEHOLDER.ljust(NOTE_BYTES))
    except OSError:
        pass


def reserved(folder: Path, job: str, restart: int, rank: int, slot: Slot | None = None) -> bool:
    """This rank's attempt started training: its note's space was set aside (or its note is written)."""
    if slot is not None and _space(folder, job, restart, slot[0]).is_file():
        return True
    return _path(folder, job, restart, rank).is_file()


def release(folder: Path, job: str, restart: int, rank: int, slot: Slot | None = None) -> None:
    """This rank leaves without a note: its placeholder goes (a note written over it stays), its node's space
    file too when this is the node's local rank 0 and no slot holds a note, and the attempt's folder with
    them once empty. Never raises."""
    path = _path(folder, job, restart, rank)
    gone = _unlink_unused(path)
    if slot is not None and slot[1] == 0:
        gone = _unlink_unused(_space(folder, job, restart, slot[0])) or gone
    if gone:
        with contextlib.suppress(OSError):
            path.parent.rmdir()  # only once empty: the other ranks' placeholders, a note, the batch shell's state


def _unlink_unused(path: Path) -> bool:
    """Remove `path` if it holds placeholders only; whether it did."""
    try:
        data = path.read_bytes()
        if any(_note_in(data[i : i + NOTE_BYTES]) for i in range(0, len(data), NOTE_BYTES)):
            return False
        path.unlink()
    except OSError:
        return False
    return True


def _note_in(chunk: bytes) -> dict[str, Any] | None:
    """The note in one slot (or one rank's file), None for a placeholder, a torn note or nothing."""
    try:
        record = json.loads(chunk)
    except ValueError:
        return None if chunk.startswith(_PLACEHOLDER) or not chunk.strip() else {"torn": True}
    return record if isinstance(record, dict) and isinstance(record.get("rank"), int) else None


def note(
    folder: Path, job: str, restart: int, rank: int, node: str, error: BaseException, slot: Slot | None = None
) -> None:
    """Write this rank's note about `error` (never raises: a rank on its way out must not fail again here)."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip("\n")
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    record = {
        "rank": rank,
        "node": node,
        "time": time.time(),
        "type": type(error).__name__,
        "message": message[:2000],
        "traceback": text[-20000:],
        "signature": signature(type(error).__name__, message),
        # The kit stopped the run on purpose (checkpoints cannot be written...): a retry fails the same way.
        "retry": not isinstance(error, (RunStopped, UsageError)),
        # A user's mistake (exit 2): the first cause even where a peer's failure on it was seen first.
        "usage": isinstance(error, UsageError),
    }
    data = _encoded(record)
    path = _path(folder, job, restart, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)
    except OSError as e:
        if is_full(e) and not _over_placeholder(path, data) and slot is not None:
            _into_slot(_space(folder, job, restart, slot[0]), slot[1], data)


def _encoded(record: dict[str, Any]) -> bytes:
    """The note as JSON, at most NOTE_BYTES: a traceback too long for that keeps its last lines."""
    data, text = json.dumps(record).encode(), str(record["traceback"])
    while len(data) > NOTE_BYTES and text:
        per_char = len(json.dumps(text)) / len(text)  # JSON escapes: up to 6 bytes a character
        text = text[max(int((len(data) - NOTE_BYTES) / per_char) + 16, 1) :]
        data = json.dumps({**record, "traceback": "..." + text if text else ""}).encode()
    return data


def _over_placeholder(path: Path, data: bytes) -> bool:
    """Write `data` over this rank's placeholder, in place (its blocks are allocated: a full disk takes it),
    padded with blanks to its length (JSON allows trailing blanks); whether it did. A rank killed midway
    leaves a torn note, which the readers skip, as they would a lost one."""
    return _write_at(path, 0, data, exact=True)


def _into_slot(path: Path, local: int, data: bytes) -> bool:
    """Write `data` into this rank's slot of its node's space file, in place, the same way."""
    return _write_at(path, local * NOTE_BYTES, data, exact=False)


def _write_at(path: Path, offset: int, data: bytes, exact: bool) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError:
        return False  # none was set aside (the disk was full already when the attempt started)
    try:
        size = os.fstat(fd).st_size
        room = size if exact else NOTE_BYTES
        if size < offset + room or room < len(data):
            return False
        os.pwrite(fd, data.ljust(room), offset)
        os.fsync(fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def read(folder: Path, job: str, restart: int) -> list[dict[str, Any]]:
    """The notes of one attempt, oldest first: the ranks' own files and their nodes' slots; unreadable ones are
    skipped."""
    notes = []
    where = attempt_folder(folder, job, restart)
    for p in sorted(where.glob("rank*.json")):
        try:
            record = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("rank"), int):
            notes.append(record)
    for p in sorted(where.glob(SPACE.format("*"))):
        try:
            data = p.read_bytes()
        except OSError:
            continue
        slots = (_note_in(data[i : i + NOTE_BYTES]) for i in range(0, len(data), NOTE_BYTES))
        notes.extend(n for n in slots if n is not None and "rank" in n)
    return sorted(notes, key=lambda r: float(r.get("time") or 0))
