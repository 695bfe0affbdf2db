"""The preemption record, `<folder>/preempted.json`: what rank 0 writes after the agreed save of a preemption.

Facts, for the attempt's supervisor to decide on (hpc_ddp.launch.supervisor applies --max-requeue): the
signal, how many ranks voted to requeue (SIGUSR1/SIGUSR2) or to stop (SIGTERM), the step saved, and whether
the signals ask for a requeue at all (no stop vote). Rank 0 decides alone only where no supervisor of the kit
is there to (mode "scontrol": --requeue-by scontrol, or auto in a plain srun step); then `requeued` says what
it did.

Read by the local launcher (start again?), the batch shell's `end` step and `submit --wait` (did the ranks
save?). The record of an earlier preemption may stay in the folder for the user: a supervisor takes it as its
attempt's only when it was written after the attempt began (`since`). No torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from hpc_ddp.ledger.files import atomic_write_bytes
from hpc_ddp.ledger.values import int_or_none

PREEMPTED = "preempted.json"


@dataclass(frozen=True)
class Preempted:
    requeue: bool  # the signals ask to start again: a requeue vote and no stop vote
    signal: str  # the signal that stopped the run (SIGUSR2, SIGTERM, ...)
    mode: str  # "scontrol": rank 0 decided and requeued itself; "exit": the attempt's supervisor decides
    step: int | None = None  # the step of the checkpoint saved at the agreed stop
    requeue_votes: int = 0  # ranks that got SIGUSR1/SIGUSR2
    stop_votes: int = 0  # ranks that got SIGTERM
    requeued: bool | None = (
        None  # mode "scontrol" only: rank 0 requeued the job (--max-requeue applied there)
    )


def write(folder: Path, record: Preempted) -> None:
    atomic_write_bytes(Path(folder) / PREEMPTED, (json.dumps(asdict(record)) + "\n").encode())


def read(folder: Path) -> Preempted | None:
    """The record of the last preemption, or None (none, or unreadable: then nobody restarts anything)."""
    try:
        data = json.loads((Path(folder) / PREEMPTED).read_text())
        return Preempted(
            requeue=bool(data["requeue"]),
            signal=str(data.get("signal", "")),
            mode=str(data.get("mode", "")),
            step=int_or_none(data.get("step")),
            requeue_votes=int_or_none(data.get("requeue_votes")) or 0,
            stop_votes=int_or_none(data.get("stop_votes")) or 0,
            requeued=data.get("requeued") if isinstance(data.get("requeued"), bool) else None,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear(folder: Path) -> None:
    """Forget an earlier preemption before the ranks start (the local launcher, at each start)."""
    (Path(folder) / PREEMPTED).unlink(missing_ok=True)


def since(folder: Path, began: float) -> bool:
    """Did the ranks save after a preemption since `began` (a time.time())?"""
    try:
        return (Path(folder) / PREEMPTED).stat().st_mtime >= began
    except OSError:
        return False


def read_since(folder: Path, began: float) -> Preempted | None:
    """The record, if it was written since `began`: this attempt's own, not one kept from an earlier one."""
    return read(folder) if since(folder, began) else None
