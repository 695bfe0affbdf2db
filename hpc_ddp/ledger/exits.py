"""What each rank ended with, for its supervisor: `<folder>/exits/<job>-<restart>/rank<N>.json`.

A rank that leaves on an exception writes one small note before it goes: its node, the time, the exception's
type, message and traceback, and the error's signature (hpc_ddp.ledger.signature). The supervisor (the local
launcher, or the batch shell after srun returns) reads the notes of the attempt that just ended to tell the
error that started it from the errors it caused on the other ranks (a peer that vanished), to blame a node
for a hardware error, and to show the first error's traceback once. A rank killed by a signal writes nothing:
its supervisor sees the signal instead. No torch.
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Any

from hpc_ddp.errors import RunStopped
from hpc_ddp.ledger.files import atomic_write_bytes
from hpc_ddp.ledger.signature import signature

EXITS = "exits"


def attempt_folder(folder: Path, job: str, restart: int) -> Path:
    return Path(folder) / EXITS / f"{job}-{restart}"


def note(folder: Path, job: str, restart: int, rank: int, node: str, error: BaseException) -> None:
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
        "retry": not isinstance(error, RunStopped),
    }
    try:
        where = attempt_folder(folder, job, restart)
        where.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(where / f"rank{rank}.json", json.dumps(record).encode())
    except OSError:
        pass


def read(folder: Path, job: str, restart: int) -> list[dict[str, Any]]:
    """The notes of one attempt, oldest first; unreadable ones are skipped."""
    notes = []
    for p in sorted(attempt_folder(folder, job, restart).glob("rank*.json")):
        try:
            record = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("rank"), int):
            notes.append(record)
    return sorted(notes, key=lambda r: float(r.get("time") or 0))
